"""Tooling that only tests and benchmarks use: static resource and SASS analysis of the CUDA
kernels, and the transformers reference model of the parity tests. Not shipped, never imported
by the engine (tests/repo/test_import_rules.py)."""
