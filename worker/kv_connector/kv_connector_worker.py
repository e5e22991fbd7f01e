"""`KVConnectorWorker`: the worker side of a KV connector (vLLM's `KVConnectorBase_V1`, worker
role), and the step it wraps around the model's forward (`execute_with_connector`).

Per step: `bind_connector_metadata(meta)`, `start_load_kv()` (transfers begin; the forward runs
meanwhile), the forward, during which a layer may `wait_for_layer_load(layer)` and
`save_kv_layer(layer, ...)` (for connectors that move KV layer by layer; the offloading
connector moves whole blocks and needs neither), `wait_for_save()` after it, then
`get_finished(finished_req_ids)` -> (finished_sending, finished_recving) and
`take_connector_output()` for the `ModelRunnerOutput`, and `clear_connector_metadata()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from core_engine.proto import ModelRunnerOutput, SchedulerOutput
from core_engine.proto.kv_transfer import (
    KVConnectorHandshake,
    KVConnectorMetadata,
    KVConnectorOutput,
)


class KVConnectorWorker(Protocol):
    def handshake(self) -> KVConnectorHandshake:
        """This rank's side, for `WorkerReady` (may read the disk: call it once per start-up)."""
        ...

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The device's per-layer caches, [K/V, block, token, head, dim] each."""
        ...

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer_index: int) -> None: ...

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks the connector no longer reads, requests whose blocks have
        loaded); the step's loads are done when this returns."""
        ...

    def take_connector_output(self) -> KVConnectorOutput: ...

    def clear_connector_metadata(self) -> None: ...

    def shutdown(self) -> None: ...


def execute_with_connector(
    connector: KVConnectorWorker | None,
    scheduler_output: SchedulerOutput,
    execute_model: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> ModelRunnerOutput:
    """One step with the connector's transfers around the forward; its report rides in
    `ModelRunnerOutput.kv_connector_output`."""
    if connector is None:
        return execute_model(scheduler_output)
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        output = execute_model(scheduler_output)
        connector.wait_for_save()
        connector.get_finished(scheduler_output.finished_req_ids)
        output.kv_connector_output = connector.take_connector_output()
    finally:
        connector.clear_connector_metadata()
    return output
