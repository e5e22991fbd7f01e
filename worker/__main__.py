"""`python -m core_engine.worker ...`: one device process, started by the engine core's MultiprocExecutor, or by
hand (ssh, a cluster launcher) on another host.

Local (the MultiprocExecutor's child): `--pipe-fd FD --dist-init-address ADDR --config B64`; the pipe is
a socketpair end the core passed down. Remote: `--core-address tcp://HOST:PORT` only; the worker
connects to the core, says `WorkerHello` and gets the config and the torch.distributed address
in `WorkerWelcome` (see `worker.core_link`), or the core's reason for refusing it (exit 1).

Protocol (over the `MessagePipe`, either kind): load the model and profile memory, send
`WorkerReady`; on `InitKVCache` allocate and send `KVCacheReady`; on each `SchedulerOutput` run
one step (rank 0 sends the `ModelRunnerOutput`); on `Shutdown` exit 0. Any exception is sent as
`WorkerError` and the process exits 1. A local worker ignores SIGINT (the core decides when
workers stop). A dead core closes the pipe, which ends a worker waiting for a message at once;
a worker busy loading a model notices within a second (a local one by its parent's exit, a
remote one by its connection's end, or, when the core's host vanished, by TCP keepalive).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time

from core_engine.common.config_error import ConfigError
from core_engine.common.process_watch import exit_when_disconnected, exit_when_orphaned
from core_engine.proto import (
    InitKVCache,
    KVCacheReady,
    MessageDecoder,
    MessageEncoder,
    SchedulerOutput,
    Shutdown,
    WorkerError,
)
from core_engine.proto.endpoints import parse_tcp_address
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.message_pipe import MessagePipe, PeerClosedError
from core_engine.worker.core_link import JoinError, join_core
from core_engine.worker.host_allocator import keep_freed_memory
from core_engine.worker.worker_factory import make_worker, worker_ready
from core_engine.worker.worker_protocol import WorkerProtocol

logger = logging.getLogger("worker")

# An orphaned worker gets SIGTERM (which it does not handle) and is hard-exited this much later.
ORPHAN_EXIT_GRACE_S = 1.0
# How long a remote worker keeps trying to reach its core (which may start after it).
DEFAULT_CONNECT_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker[{args.rank}] %(levelname)s %(message)s"
    )
    if args.core_address is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_when_orphaned(os.getppid(), ORPHAN_EXIT_GRACE_S)
        config = EngineConfig.from_b64(args.config)
        pipe = MessagePipe.from_fd(args.pipe_fd)
        dist_init_address = args.dist_init_address
        stop_link_watch = None
    else:
        try:
            pipe, welcome = join_core(
                args.core_address, args.rank, args.world_size, args.connect_timeout_s
            )
        except JoinError as exc:
            logger.error("worker rank %d cannot join: %s", args.rank, exc)
            return 1
        config, dist_init_address = welcome.config, welcome.dist_init_address
        logger.info(
            "worker rank %d joined the engine core at %s (torch.distributed at %s)",
            args.rank,
            args.core_address,
            dist_init_address,
        )
        what = f"the engine core at {args.core_address}"
        stop_link_watch = exit_when_disconnected(pipe.fileno(), ORPHAN_EXIT_GRACE_S, what)
    keep_freed_memory()
    _export_distributed_env(dist_init_address, args.rank, args.world_size)
    try:
        # A local worker's config error is the core's to report; a remote one's log says it too.
        config_error_level = logging.DEBUG if stop_link_watch is None else logging.ERROR
        return _run(config, args.rank, args.world_size, pipe, args.local_rank, config_error_level)
    except KeyboardInterrupt:  # Ctrl-C on a worker started by hand
        logger.warning("worker rank %d interrupted", args.rank)
        return 130
    finally:
        if stop_link_watch is not None:
            stop_link_watch.set()
        pipe.close()


def _run(
    config: EngineConfig,
    rank: int,
    world_size: int,
    pipe: MessagePipe,
    local_rank: int | None,
    config_error_level: int = logging.DEBUG,
) -> int:
    """Loads the worker, says ready and serves until Shutdown (0), a failure or the core's end
    (1). A `ConfigError` is sent as such, and logged in one line at `config_error_level`."""
    encoder = MessageEncoder()
    try:
        start = time.monotonic()
        worker = make_worker(config, rank, world_size, local_rank)
        worker.load_model()
        _share_cpu_cores(config, worker, world_size)
        ready = worker_ready(worker, rank)
        logger.info(worker.describe(ready, time.monotonic() - start))
        pipe.send(encoder.encode(ready))
        _serve(worker, rank, pipe, encoder)
        _leave_process_group(config, world_size)
        return 0
    except PeerClosedError as exc:
        logger.warning("worker rank %d exits: the engine core closed the pipe (%s)", rank, exc)
        return 1
    except ConfigError as exc:  # the user's to fix: the core reports it, in one line
        logger.log(config_error_level, "worker rank %d cannot run with its settings: %s", rank, exc)
        with contextlib.suppress(OSError):
            pipe.send(encoder.encode(WorkerError(rank, str(exc), is_config_error=True)))
        return 1
    except Exception as exc:
        logger.exception("worker rank %d failed", rank)
        message = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            pipe.send(encoder.encode(WorkerError(rank, message)))
        return 1


def _serve(worker: WorkerProtocol, rank: int, pipe: MessagePipe, encoder: MessageEncoder) -> None:
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


def _share_cpu_cores(config: EngineConfig, worker: WorkerProtocol, world_size: int) -> None:
    """A CPU model worker shares the usable cores among the tensor-parallel ranks of every
    data-parallel engine core (see `share_cpu_threads`)."""
    if config.is_null_model or worker.device.type != "cpu":
        return
    from core_engine.worker.parallel_state import share_cpu_threads

    share_cpu_threads(world_size * config.data_parallel_size)


def _leave_process_group(config: EngineConfig, world_size: int) -> None:
    """A clean exit leaves the tensor-parallel group (NCCL warns about a group never destroyed)."""
    if world_size > 1 and not config.is_null_model:
        from core_engine.worker.parallel_state import destroy_distributed

        destroy_distributed()


def _export_distributed_env(dist_init_address: str, rank: int, world_size: int) -> None:
    """torch.distributed's env:// rendezvous variables, for tensor-parallel workers."""
    host, port = parse_tcp_address(dist_init_address, "the torch.distributed address")
    os.environ.update(
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m core_engine.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--core-address",
        default=None,
        help="tcp://HOST:PORT of the engine core's --worker-address: join it from this host "
        "(instead of --pipe-fd, --dist-init-address and --config)",
    )
    parser.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="with --core-address on CUDA: this rank's GPU index on its host (default: the "
        "rank itself, right only when the host runs ranks 0..)",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="with --core-address: how long to keep trying to reach the core "
        f"(default: {DEFAULT_CONNECT_TIMEOUT_S:.0f})",
    )
    parser.add_argument("--pipe-fd", type=int, help="this process's end of the core's MessagePipe")
    parser.add_argument("--dist-init-address", help="tcp://HOST:PORT")
    parser.add_argument("--config", help="EngineConfig.to_b64()")
    args = parser.parse_args(argv)
    local_flags = {
        "--pipe-fd": args.pipe_fd,
        "--dist-init-address": args.dist_init_address,
        "--config": args.config,
    }
    if args.core_address is not None:
        given = [flag for flag, value in local_flags.items() if value is not None]
        if given:
            parser.error(f"--core-address takes the rest from the core; drop {', '.join(given)}")
    else:
        missing = [flag for flag, value in local_flags.items() if value is None]
        if missing:
            parser.error(f"give --core-address, or all of {', '.join(local_flags)}")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, --world-size={args.world_size}), got {args.rank}")
    return args


if __name__ == "__main__":
    sys.exit(main())
