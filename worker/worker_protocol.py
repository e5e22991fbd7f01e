"""`WorkerProtocol`: what the worker process and the in-process executor drive, whichever
worker the config asks for (`Worker` for a model, `NullWorker` for "null")."""

from __future__ import annotations

from typing import Protocol

from core_engine.proto import ModelRunnerOutput, SchedulerOutput, WorkerReady
from core_engine.proto.kv_transfer import KVConnectorHandshake
from core_engine.proto.lora_request import LoRATargetShapes


class WorkerProtocol(Protocol):
    """Lifecycle: `load_model()` -> `determine_num_available_blocks()` ->
    `initialize_cache(n)` -> `execute_model(scheduler_output)` per step. The limits below are
    known once `load_model()` has returned; they are what the worker reports in `WorkerReady`.
    """

    rank: int
    block_size: int
    max_num_seqs: int

    @property
    def device(self) -> object: ...  # a torch.device, or "cpu" for the null model

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def layer_sliding_windows(self) -> list[int | None]: ...

    @property
    def kv_connector_handshake(self) -> KVConnectorHandshake | None: ...

    @property
    def lora_target_shapes(self) -> LoRATargetShapes | None: ...

    def load_model(self) -> None: ...

    def determine_num_available_blocks(self) -> int: ...

    def initialize_cache(self, num_gpu_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def describe(self, ready: WorkerReady, load_s: float) -> str:
        """The start-up log line: what runs where, and how much KV fits."""
        ...
