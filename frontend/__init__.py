"""What users touch: `LLM` (offline), `EngineClient` / `AsyncEngineClient`, the OpenAI server.

from core_engine.frontend import LLM
from core_engine.proto import SamplingParams

with LLM() as llm:  # the default SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from core_engine.common.config_error import ConfigError
from core_engine.frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    ServiceStoppedError,
)
from core_engine.frontend.core_client import EngineCoreNotFoundError, EngineDeadError
from core_engine.frontend.engine_client import EngineClient
from core_engine.frontend.llm import LLM
from core_engine.frontend.request_output import CompletionOutput, RequestOutput
from core_engine.proto import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngineClient",
    "CompletionOutput",
    "ConfigError",
    "EngineClient",
    "EngineCoreNotFoundError",
    "EngineDeadError",
    "InvalidPromptError",
    "RequestOutput",
    "SamplingParams",
    "ServiceStoppedError",
]
