"""The scheduler process: requests, KV block pool and manager, scheduler, engine core.

Runs without torch or a GPU: it handles block metadata only, never KV memory.
"""
