"""`TcpConnectorWorker`: the worker side of the TcpConnector (prefill/decode disaggregation).

Producer: a `KVBlockServer` serves the blocks of finished requests the step's metadata names
(`sends`) and reports each in `finished_sending` once its consumer released it (or it expired).
Consumer: each `RequestPull` runs on a thread over several steps (the other requests keep
stepping); a finished pull's bytes are copied into its device blocks in the step that reports
it in `finished_recving`, on the step's thread, so device blocks are only written between
forwards. A pull that fails is reported in `failed_recving` (the request computes those tokens).
A request that finished meanwhile (aborted) has its pull dropped before anything is copied: its
blocks may already belong to another request.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from core_engine.proto.kv_transfer import (
    KVConnectorHandshake,
    KVConnectorOutput,
    KVTransferConfig,
    RequestPull,
    TcpConnectorMetadata,
)
from core_engine.worker.kv_connector.host_kv_tier import gather_device_blocks, scatter_device_blocks
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout
from core_engine.worker.kv_connector.kv_block_puller import KVPullError, pull_blocks
from core_engine.worker.kv_connector.kv_block_server import KVBlockServer

logger = logging.getLogger(__name__)

MAX_CONCURRENT_PULLS = 4
# A step that runs no request waits up to this long for a transfer to end (instead of
# spinning empty steps while blocks are held or pulled).
IDLE_WAIT_S = 0.02


class TcpConnectorWorker:
    def __init__(
        self,
        transfer: KVTransferConfig,
        layout: KVBlockLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.layout_json = layout.to_json()
        self.dtype = dtype
        self.device = device
        self.bytes_per_block = layout.num_elements * torch.empty((), dtype=dtype).element_size()
        self.pull_timeout_s = float(transfer.tcp_option("pull_timeout_s"))
        self.kv_caches: list[torch.Tensor] = []
        self.engine_id = uuid.uuid4().hex
        self.server: KVBlockServer | None = None
        if transfer.is_kv_producer:
            self.server = KVBlockServer(
                transfer.tcp_option("host"),
                transfer.tcp_option("port"),
                self.engine_id,
                self.layout_json,
                self._read_blocks,
                float(transfer.tcp_option("send_timeout_s")),
            )
            logger.info(
                "KV block server of engine %s on %s:%d (TcpConnector %s)",
                self.engine_id,
                self.server.host,
                self.server.port,
                transfer.kv_role,
            )
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="kv-pull")
        self._pulls: dict[str, tuple[RequestPull, Future]] = {}
        self._releases: list[Future] = []  # release-only pulls: nothing to report
        self._metadata = TcpConnectorMetadata()
        self._output = KVConnectorOutput()

    def handshake(self) -> KVConnectorHandshake:
        server = self.server
        return KVConnectorHandshake(
            bytes_per_block=self.bytes_per_block,
            num_host_blocks=0,
            transfer_host=server.host if server is not None else "",
            transfer_port=server.port if server is not None else 0,
            engine_id=self.engine_id,
        )

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: TcpConnectorMetadata | None) -> None:
        self._metadata = metadata if metadata is not None else TcpConnectorMetadata()
        self._output = KVConnectorOutput()

    def start_load_kv(self) -> None:
        """Registers the step's holds with the server and starts its pulls."""
        for send in self._metadata.sends:
            self.server.register(send)
        for pull in self._metadata.pulls:
            args = (pull, self.layout_json, self.bytes_per_block, self.pull_timeout_s)
            future = self._pool.submit(pull_blocks, *args)
            if pull.local_block_ids:
                self._pulls[pull.req_id] = (pull, future)
            else:
                self._releases.append(future)
        self._releases = [f for f in self._releases if not f.done()]

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing: a pulling request is not in the step's batch."""

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """Nothing: the producer serves whole blocks from the device cache."""

    def wait_for_save(self) -> None:
        """Nothing: blocks are served when a consumer asks."""

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        """(holds ended, pulls copied into their blocks); failed pulls go to the output's
        `failed_recving`. Pulls of requests in `finished_req_ids` are dropped first."""
        for request_id in finished_req_ids:
            self._pulls.pop(request_id, None)
        if self._metadata.idle:
            self._wait_a_little()
        finished_recving = self._collect_pulls()
        finished_sending = set(self.server.take_ended()) if self.server is not None else set()
        self._output.finished_sending = sorted(finished_sending)
        return finished_sending, finished_recving

    def _wait_a_little(self) -> None:
        pending = [future for _, future in self._pulls.values()]
        if pending:
            wait(pending, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        elif self.server is not None and self.server.num_holds:
            self.server.wait_for_release(IDLE_WAIT_S)

    def _collect_pulls(self) -> set[str]:
        finished = set()
        start = time.perf_counter()
        for request_id, (pull, future) in list(self._pulls.items()):
            if not future.done():
                continue
            del self._pulls[request_id]
            try:
                payload = future.result()
            except KVPullError as exc:
                logger.warning("%s: its prompt is computed here instead", exc)
                self._output.failed_recving.append(request_id)
                continue
            self._write_blocks(pull.local_block_ids, payload)
            finished.add(request_id)
            self._output.num_bytes_loaded += len(payload)
        if finished:
            self._output.load_s += time.perf_counter() - start
        self._output.finished_recving = sorted(finished)
        return finished

    def _write_blocks(self, block_ids: list[int], payload: bytearray) -> None:
        data = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        scatter_device_blocks(self.kv_caches, block_ids, data.view(-1, *self.layout.shape))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _read_blocks(self, block_ids: list[int]) -> memoryview:
        """(On a server thread.) The held blocks' bytes, [block, layer, K/V, token, head, dim]."""
        data = gather_device_blocks(self.kv_caches, block_ids)
        return memoryview(data.view(torch.uint8).numpy()).cast("B")

    def take_connector_output(self) -> KVConnectorOutput:
        return self._output

    def clear_connector_metadata(self) -> None:
        self._metadata = TcpConnectorMetadata()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
