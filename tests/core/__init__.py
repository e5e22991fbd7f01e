"""Tests of `core/`: block pool, KV cache manager, scheduler, connectors' scheduler side,
speculative decoding's drafting, the engine core, placement."""
