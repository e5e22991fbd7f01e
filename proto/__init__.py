"""Every message that crosses a process boundary, and the typed codec for them."""

from proto.codec import MessageDecodeError, MessageDecoder, MessageEncoder
from proto.engine_messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    FinishReason,
    KVCacheEvents,
    SchedulerStats,
    TokenLogprobs,
    UtilityRequest,
    UtilityResponse,
)
from proto.sampling_params import SamplingParams
from proto.worker_messages import (
    CachedRequestData,
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
)

__all__ = [
    "AbortRequests",
    "CachedRequestData",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDead",
    "EngineReady",
    "FinishReason",
    "InitKVCache",
    "KVCacheEvents",
    "KVCacheReady",
    "MessageDecodeError",
    "MessageDecoder",
    "MessageEncoder",
    "ModelRunnerOutput",
    "NewRequestData",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "Shutdown",
    "TokenLogprobs",
    "UtilityRequest",
    "UtilityResponse",
    "WorkerError",
    "WorkerReady",
]
