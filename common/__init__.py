"""Low-level helpers every process shares: GGUF reading, model file lookup, process control,
the dtype table and integer math.

Imports nothing of ours and no torch at import time, so `core/`, `frontend/`, `worker/` and
`kernels/` may all use it.
"""
