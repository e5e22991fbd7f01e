"""Offline throughput, `LLM.generate` against transformers, vLLM and llama.cpp:
`python -m benchmarks.offline [--quick]`."""
