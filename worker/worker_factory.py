"""A worker built from the engine's `EngineConfig`, and the `WorkerReady` it answers with.

The worker process (`python -m worker`) and the in-process `LocalExecutor` both build their
worker here, so a config means the same worker in either.
"""

from __future__ import annotations

from proto import WorkerReady
from proto.engine_config import EngineConfig


def make_worker(
    config: EngineConfig, rank: int = 0, world_size: int = 1, local_rank: int | None = None
):
    """The NullWorker for model "null" (no torch import), else the real Worker (whose CPU KV
    budget CORE_ENGINE_KV_CACHE_MEMORY_BYTES may set, per rank). The model is not loaded yet."""
    extra_kwargs = {}
    if config.is_null_model:
        from worker.null_worker import NullWorker as worker_class
    else:
        from worker.memory_profiler import kv_cache_memory_bytes_from_env
        from worker.worker import Worker as worker_class

        extra_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes_from_env(rank, world_size)
    return worker_class(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        rank=rank,
        world_size=world_size,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        enforce_eager=config.enforce_eager,
        disable_hybrid_kv_cache=config.disable_hybrid_kv_cache,
        device_rank=device_rank(config, rank) if local_rank is None else local_rank,
        **extra_kwargs,
    )


def device_rank(config: EngineConfig, rank: int) -> int:
    """The GPU index of tensor-parallel rank `rank` of data-parallel core
    `config.data_parallel_rank`: each core takes the next `tensor_parallel_size` GPUs."""
    return config.data_parallel_rank * config.tensor_parallel_size + rank


def worker_ready(worker, rank: int, num_gpu_blocks: int | None = None) -> WorkerReady:
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
        layer_sliding_windows=list(getattr(worker, "layer_sliding_windows", [])),
    )


def describe_worker(worker, ready: WorkerReady, load_s: float) -> str:
    """The start-up log line of a loaded worker: what runs where, and how much KV fits."""
    if not hasattr(worker, "model_config"):  # the null model
        return f"worker rank {ready.rank}: null model on {ready.device}, {ready.num_gpu_blocks} KV blocks"
    import torch

    device = worker.device
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    kv_bytes = ready.num_gpu_blocks * worker.bytes_per_block
    groups = worker.kv_cache_groups
    if len(groups) == 1:
        blocks = f"{ready.num_gpu_blocks * ready.block_size} tokens"
    else:  # a token takes a block slot in every group: the pool holds no fixed token count
        windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
        blocks = (
            f"{len(groups[0].layer_indices)} layers each, shared by {len(groups)} KV cache groups "
            f"(sliding windows {windows} and full attention)"
        )
    return (
        f"worker rank {ready.rank}: {worker.model_path} ({worker.model_config.architecture}) on "
        f"{device}, {str(worker.dtype).removeprefix('torch.')}{threads}, loaded in {load_s:.1f} s; "
        f"room for a KV cache of {kv_bytes / 2**30:.2f} GiB = {ready.num_gpu_blocks} blocks of "
        f"{ready.block_size} = {blocks}"
    )
