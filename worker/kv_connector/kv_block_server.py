"""`KVBlockServer`: a producer worker's TCP server of the KV blocks it holds for decode
instances (the TcpConnector's producer side; the wire is `proto.kv_pull_messages`).

Threads: one accepts, one per connection serves. The step's thread registers holds
(`register`) and takes the ones that ended (`take_ended`); only then may the scheduler free
their blocks, so a block is never read after it could be reused: a hold ends when its consumer
releases it, or when `send_timeout_s` passes with no pull being served.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from core_engine.proto.kv_pull_messages import ConsumerMessage, KVPull, KVPullReply, KVRelease
from core_engine.proto.kv_transfer import RequestSend
from core_engine.worker.kv_connector.kv_pull_socket import receive_message, send_message

logger = logging.getLogger(__name__)

# A pull may arrive before the step that registers its hold (the prefill's answer races the
# next step): it waits this long for it.
REGISTRATION_WAIT_S = 5.0
CONNECTION_TIMEOUT_S = 30.0


@dataclass(slots=True)
class _Hold:
    block_id_to_hash: dict[int, bytes]
    deadline: float
    num_serving: int = 0
    released: bool = False


@dataclass(slots=True)
class _Holds:
    """Request id -> hold, guarded by `condition` (notified on every change)."""

    by_request: dict[str, _Hold] = field(default_factory=dict)
    condition: threading.Condition = field(default_factory=threading.Condition)


class KVBlockServer:
    """Serves `read_blocks(block_ids)` (the blocks' bytes, in order) for held requests.

    `layout`: this rank's `KVBlockLayout` JSON; a pull of another layout is refused."""

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        layout: str,
        read_blocks: Callable[[list[int]], memoryview],
        send_timeout_s: float,
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.read_blocks = read_blocks
        self.send_timeout_s = send_timeout_s
        self._holds = _Holds()
        self._decoder = msgspec.msgpack.Decoder(ConsumerMessage)
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-server", daemon=True)
        self._acceptor.start()

    # ---- the step's thread -----------------------------------------------------------------

    def register(self, send: RequestSend) -> None:
        hold = _Hold(
            dict(zip(send.block_ids, send.block_hashes, strict=True)),
            time.monotonic() + self.send_timeout_s,
        )
        with self._holds.condition:
            self._holds.by_request[send.req_id] = hold
            self._holds.condition.notify_all()

    def take_ended(self) -> list[str]:
        """Holds released by their consumer, or expired with no pull being served: forgotten
        here, so their blocks may be freed."""
        now = time.monotonic()
        ended = []
        with self._holds.condition:
            for request_id, hold in list(self._holds.by_request.items()):
                expired = hold.deadline <= now and hold.num_serving == 0
                if hold.released or expired:
                    if expired and not hold.released:
                        logger.warning(
                            "KV blocks of %s held %.0f s with no decode instance pulling them: "
                            "freed",
                            request_id,
                            self.send_timeout_s,
                        )
                    del self._holds.by_request[request_id]
                    ended.append(request_id)
        return ended

    def wait_for_release(self, timeout_s: float) -> None:
        """Returns when a hold is released, or after `timeout_s`."""
        with self._holds.condition:
            if not any(h.released for h in self._holds.by_request.values()):
                self._holds.condition.wait(timeout_s)

    @property
    def num_holds(self) -> int:
        with self._holds.condition:
            return len(self._holds.by_request)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    # ---- server threads --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve_connection, args=(connection,), name="kv-serve", daemon=True
            ).start()

    def _serve_connection(self, connection: socket.socket) -> None:
        connection.settimeout(CONNECTION_TIMEOUT_S)
        try:
            with connection:
                message = receive_message(connection, self._decoder)
                if isinstance(message, KVPull):
                    self._serve_pull(connection, message)
                    message = receive_message(connection, self._decoder)
                if isinstance(message, KVRelease):
                    self._release(message)
        except (OSError, ValueError) as exc:
            logger.info("KV block server: a connection ended early: %s", exc)

    def _serve_pull(self, connection: socket.socket, pull: KVPull) -> None:
        error = self._refusal(pull)
        if error is not None:
            send_message(connection, KVPullReply(self.layout, error=error))
            return
        try:
            payload = self.read_blocks(pull.block_ids)
        finally:
            self._end_serving(pull.request_id)
        send_message(connection, KVPullReply(self.layout, num_payload_bytes=payload.nbytes))
        connection.sendall(payload)

    def _refusal(self, pull: KVPull) -> str | None:
        """Why `pull` cannot be served (None: it can, and its hold is marked serving)."""
        if pull.engine_id != self.engine_id:
            return (
                f"engine {pull.engine_id} is not this one ({self.engine_id}): the prefill "
                "instance restarted since it answered"
            )
        if pull.layout != self.layout:
            return f"the consumer's KV layout {pull.layout} differs from this one {self.layout}"
        with self._holds.condition:
            hold = self._wait_for_hold(pull.request_id)
            if hold is None:
                return f"no KV blocks are held for request {pull.request_id}"
            if len(pull.block_ids) != len(pull.block_hashes):
                return "a pull must name one hash per block"
            for block_id, block_hash in zip(pull.block_ids, pull.block_hashes, strict=True):
                if hold.block_id_to_hash.get(block_id) != block_hash:
                    return f"block {block_id} of {pull.request_id} does not hold the tokens asked"
            hold.num_serving += 1
        return None

    def _wait_for_hold(self, request_id: str) -> _Hold | None:
        deadline = time.monotonic() + REGISTRATION_WAIT_S
        while (hold := self._holds.by_request.get(request_id)) is None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            self._holds.condition.wait(remaining_s)
        return hold

    def _end_serving(self, request_id: str) -> None:
        with self._holds.condition:
            hold = self._holds.by_request.get(request_id)
            if hold is not None:
                hold.num_serving -= 1

    def _release(self, release: KVRelease) -> None:
        if release.engine_id != self.engine_id:
            return
        with self._holds.condition:
            hold = self._holds.by_request.get(release.request_id)
            if hold is not None:
                hold.released = True
                self._holds.condition.notify_all()
