"""The engine's benchmarks, by subject, each run as `python -m benchmarks.<subject>` (or
`python -m benchmarks.<subject>.<module>`), every figure a ratio against a baseline measured
in the same run; results (JSON and markdown) under `benchmarks/results/`, named with the CPU
flags of the machine that produced them. Not shipped: the engine never imports them.

- `harness/`: what every benchmark shares (workloads, result files, process and CPU sampling,
  engine arms, the benchmarks page);
- `peers/`: vLLM and llama.cpp started as separate programs, never imported;
- `offline/`, `serving/`, `spec_decode/`, `kv/`, `pd/`: the end-to-end benchmarks;
- `micro/`: kernels, linears, the scheduler, IPC, a decode step's profile;
- `gpu/`: the GPU kit (`python -m benchmarks.gpu`), for a GPU lent for minutes.
"""
