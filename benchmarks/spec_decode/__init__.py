"""Speculative decoding: `python -m benchmarks.spec_decode [--quick]` (latency and throughput
with and without drafts), its workloads, acceptance counts, replays and report."""
