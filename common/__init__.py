"""Low-level helpers every process shares: GGUF reading, model file lookup and the model's eos
ids, JSON files, process control, free ports, the dtype table and integer math.

Imports nothing of ours and no torch at import time, so `core/`, `frontend/`, `worker/` and
`kernels/` may all use it (`tests/repo/test_import_rules.py`).
"""
