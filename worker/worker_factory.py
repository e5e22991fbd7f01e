"""A worker built from the engine's `EngineConfig`, and the `WorkerReady` it answers with.

The worker process (`python -m core_engine.worker`) and the in-process `LocalExecutor` both build their
worker here, so a config means the same worker in either.
"""

from __future__ import annotations

from core_engine.proto import WorkerReady
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.worker_protocol import WorkerProtocol


def make_worker(
    config: EngineConfig, rank: int = 0, world_size: int = 1, local_rank: int | None = None
) -> WorkerProtocol:
    """The NullWorker for model "null" (no torch import), else the real Worker (whose CPU KV
    budget CORE_ENGINE_KV_CACHE_MEMORY_BYTES may set, per rank). The model is not loaded yet."""
    if config.is_null_model:
        from core_engine.worker.null_worker import NullWorker

        return NullWorker(config, rank)
    from core_engine.worker.memory_profiler import kv_cache_memory_bytes_from_env
    from core_engine.worker.worker import Worker

    return Worker(
        config,
        rank,
        world_size,
        device_index=device_rank(config, rank) if local_rank is None else local_rank,
        kv_cache_memory_bytes=kv_cache_memory_bytes_from_env(rank, world_size),
    )


def device_rank(config: EngineConfig, rank: int) -> int:
    """The GPU index of tensor-parallel rank `rank` of data-parallel core
    `config.data_parallel_rank`: each core takes the next `tensor_parallel_size` GPUs."""
    return config.data_parallel_rank * config.tensor_parallel_size + rank


def worker_ready(
    worker: WorkerProtocol, rank: int, num_gpu_blocks: int | None = None
) -> WorkerReady:
    """The handshake answer of a loaded `worker`: its limits, its model's vocabulary size and eos
    ids, and how many KV blocks fit (measured unless `num_gpu_blocks` is given)."""
    if num_gpu_blocks is None:
        num_gpu_blocks = worker.determine_num_available_blocks()
    return WorkerReady(
        rank=rank,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=worker.max_model_len,
        max_num_batched_tokens=worker.max_num_batched_tokens,
        device=str(worker.device),
        vocab_size=worker.vocab_size,
        block_size=worker.block_size,
        max_num_seqs=worker.max_num_seqs,
        eos_token_ids=list(worker.eos_token_ids),
        layer_sliding_windows=list(worker.layer_sliding_windows),
        kv_connector_handshake=worker.kv_connector_handshake,
        lora_target_shapes=worker.lora_target_shapes,
    )
