"""The KV cache: prefix caching (`prefix_cache`), KV offloading (`offloading`, with its
workload and report), KV memory per model shape (`memory`), and the block map's cost
(`block_map_overhead`); each `python -m benchmarks.kv.<module>`."""
