"""The peers every figure is measured against, started as separate programs and never
imported: vLLM (`vllm`, `vllm_bench_client`, `vllm_spec_decode_arm`; its own Python runs
`vllm_offline_runner.py` and `vllm_spec_decode_runner.py` as files) and llama.cpp's server
(`llama_server`)."""
