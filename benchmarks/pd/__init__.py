"""Prefill/decode disaggregation against one instance: `python -m benchmarks.pd [--quick]`."""
