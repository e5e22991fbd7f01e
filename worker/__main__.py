"""`python -m worker ...`: one device process, started by the engine core's Executor.

Protocol (over the `MessagePipe` whose end the core passes as `--pipe-fd`): load the model and
profile memory, send `WorkerReady`; on `InitKVCache` allocate and send `KVCacheReady`; on each
`SchedulerOutput` run one step (rank 0 sends the `ModelRunnerOutput`); on `Shutdown` exit 0. Any
exception is sent as `WorkerError` and the process exits 1. SIGINT is ignored (the core decides
when workers stop). A dead core closes the pipe, which ends a worker waiting for a message at
once; a worker busy loading a model notices within a second.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time

from common.process_watch import exit_when_orphaned
from proto import (
    InitKVCache,
    KVCacheReady,
    MessageDecoder,
    MessageEncoder,
    SchedulerOutput,
    Shutdown,
    WorkerError,
)
from proto.engine_config import EngineConfig
from proto.message_pipe import MessagePipe, PeerClosedError
from worker.host_allocator import keep_freed_memory
from worker.worker_factory import describe_worker, make_worker, worker_ready

logger = logging.getLogger("worker")

# An orphaned worker gets SIGTERM (which it does not handle) and is hard-exited this much later.
ORPHAN_EXIT_GRACE_S = 1.0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = EngineConfig.from_b64(args.config)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker[{args.rank}] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()
    exit_when_orphaned(os.getppid(), ORPHAN_EXIT_GRACE_S)
    _export_distributed_env(args.dist_init_address, args.rank, args.world_size)

    pipe = MessagePipe.from_fd(args.pipe_fd)
    encoder = MessageEncoder()
    try:
        start = time.monotonic()
        worker = make_worker(config, args.rank, args.world_size)
        worker.load_model()
        _share_cpu_cores(config, worker, args.world_size)
        ready = worker_ready(worker, args.rank)
        logger.info(describe_worker(worker, ready, time.monotonic() - start))
        pipe.send(encoder.encode(ready))
        _serve(worker, args.rank, pipe, encoder)
        _leave_process_group(config, args.world_size)
        return 0
    except PeerClosedError:
        logger.warning("worker rank %d exits: the engine core closed the pipe", args.rank)
        return 1
    except Exception as exc:
        logger.exception("worker rank %d failed", args.rank)
        message = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            pipe.send(encoder.encode(WorkerError(args.rank, message)))
        return 1
    finally:
        pipe.close()


def _serve(worker, rank: int, pipe: MessagePipe, encoder: MessageEncoder) -> None:
    """Answers the core's messages until `Shutdown`; malformed input raises (fatal)."""
    # No size limit: the core is trusted, and one step may carry many full prompts.
    decoder = MessageDecoder([InitKVCache, SchedulerOutput, Shutdown], sys.maxsize)
    while True:
        message = decoder.decode(pipe.recv())
        if isinstance(message, SchedulerOutput):
            model_runner_output = worker.execute_model(message)
            if rank == 0:
                pipe.send(encoder.encode(model_runner_output))
        elif isinstance(message, InitKVCache):
            worker.initialize_cache(message.num_gpu_blocks)
            pipe.send(encoder.encode(KVCacheReady(rank)))
        else:
            return


def _share_cpu_cores(config: EngineConfig, worker, world_size: int) -> None:
    """A CPU model worker shares the usable cores among the tensor-parallel ranks of every
    data-parallel engine core (see `share_cpu_threads`)."""
    if config.is_null_model or getattr(worker.device, "type", None) != "cpu":
        return
    from worker.parallel_state import share_cpu_threads

    share_cpu_threads(world_size * config.data_parallel_size)


def _leave_process_group(config: EngineConfig, world_size: int) -> None:
    """A clean exit leaves the tensor-parallel group (NCCL warns about a group never destroyed)."""
    if world_size > 1 and not config.is_null_model:
        from worker.parallel_state import destroy_distributed

        destroy_distributed()


def _export_distributed_env(dist_init_address: str, rank: int, world_size: int) -> None:
    """torch.distributed's env:// rendezvous variables, for tensor-parallel workers."""
    host, _, port = dist_init_address.removeprefix("tcp://").rpartition(":")
    os.environ.update(
        MASTER_ADDR=host,
        MASTER_PORT=port,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--pipe-fd", type=int, required=True, help="this process's end of the core's MessagePipe"
    )
    parser.add_argument("--dist-init-address", required=True, help="tcp://HOST:PORT")
    parser.add_argument("--config", required=True, help="EngineConfig.to_b64()")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
