"""What users touch: `LLM` (offline), `EngineClient` / `AsyncEngineClient`, the OpenAI server.

from frontend import LLM
from proto import SamplingParams

with LLM() as llm:  # the default SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from common.config_error import ConfigError
from frontend.async_engine_client import (
    AsyncEngineClient,
    InvalidPromptError,
    ServiceStoppedError,
)
from frontend.core_client import EngineCoreNotFoundError, EngineDeadError
from frontend.engine_client import EngineClient
from frontend.llm import LLM
from frontend.request_output import CompletionOutput, RequestOutput
from proto import SamplingParams

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
