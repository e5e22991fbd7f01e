"""`join_core`: a worker on another host connects to the engine core and is admitted.

The worker dials the core's worker address (`tcp://HOST:PORT`, the core's `--worker-address`),
retrying while nothing listens there yet (workers may start before their core), sends
`WorkerHello` and waits for the answer: `WorkerWelcome` makes the connection this rank's
`MessagePipe` to the core, exactly as the inherited socketpair of a local worker; `WorkerRejected`
ends the join with the core's reason.
"""

from __future__ import annotations

import logging
import socket
import sys
import time

from core_engine.proto import (
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    WorkerHello,
    WorkerRejected,
    WorkerWelcome,
)
from core_engine.proto.endpoints import parse_tcp_address
from core_engine.proto.message_pipe import MessagePipe, PeerClosedError, configure_tcp_link
from core_engine.proto.worker_messages import WORKER_PROTOCOL_VERSION

logger = logging.getLogger(__name__)

CONNECT_RETRY_INTERVAL_S = 0.5
# One connection attempt may take this long (a SYN to a host that drops it is never answered).
CONNECT_ATTEMPT_TIMEOUT_S = 5.0


class JoinError(RuntimeError):
    """The core was not reached in time, refused this worker, or answered nonsense."""


def join_core(
    core_address: str, rank: int, world_size: int, timeout_s: float
) -> tuple[MessagePipe, WorkerWelcome]:
    """This rank's pipe to the core at `core_address` and the core's welcome; JoinError when the
    core cannot be reached within `timeout_s` or does not admit the worker. The pipe waits
    without limit afterwards (a dead core or host is reported by the link, not by a timeout)."""
    host, port = parse_tcp_address(core_address, "--core-address")
    deadline = time.monotonic() + timeout_s
    sock = _connect(host, port, deadline, core_address)
    configure_tcp_link(sock)
    pipe = MessagePipe(sock, timeout_s=max(deadline - time.monotonic(), 1.0))
    try:
        pipe.send(MessageEncoder().encode(WorkerHello(rank, world_size, WORKER_PROTOCOL_VERSION)))
        # No size limit: the answer comes from the core this worker chose to trust.
        answer = MessageDecoder([WorkerWelcome, WorkerRejected], sys.maxsize).decode(pipe.recv())
    except MessageDecodeError as exc:
        pipe.close()
        raise JoinError(
            f"the engine core at {core_address} answered the hello with something else than a "
            f"WorkerWelcome (is it the same engine version?): {exc}"
        ) from exc
    except PeerClosedError as exc:
        pipe.close()
        raise JoinError(
            f"the engine core at {core_address} closed the connection without an answer ({exc})"
        ) from exc
    except TimeoutError as exc:
        pipe.close()
        raise JoinError(
            f"the engine core at {core_address} took the connection but did not answer the "
            f"hello within {timeout_s} s"
        ) from exc
    if isinstance(answer, WorkerRejected):
        pipe.close()
        raise JoinError(
            f"the engine core at {core_address} rejected rank {rank} of {world_size}: "
            f"{answer.reason}"
        )
    pipe.timeout_s = None
    return pipe, answer


def _connect(host: str, port: int, deadline: float, core_address: str) -> socket.socket:
    """A connected socket, retrying refused or unreachable attempts until `deadline`."""
    last_error: OSError | None = None
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise JoinError(f"no engine core answered at {core_address}: {last_error}")
        try:
            return socket.create_connection(
                (host, port), timeout=min(remaining_s, CONNECT_ATTEMPT_TIMEOUT_S)
            )
        except OSError as exc:
            if last_error is None:
                logger.info("waiting for the engine core at %s (%s)", core_address, exc)
            last_error = exc
        time.sleep(min(CONNECT_RETRY_INTERVAL_S, max(deadline - time.monotonic(), 0.0)))
