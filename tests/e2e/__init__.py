"""End to end, with real processes: the clients and `LLM`, core-serve over HTTP, the engine's
process life cycle, parallelism (tensor, data, remote workers, Ray), prefill/decode
disaggregation and KV offloading, the user scripts. All of them are marked `slow`."""
