"""What users touch: `LLM` (offline), `EngineClient` / `AsyncEngineClient`, the OpenAI server.

from core_engine.frontend import LLM
from core_engine.proto import SamplingParams

with LLM() as llm:  # the default SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)

LoRA adapters (PEFT folders), as in vLLM: `LLM(enable_lora=True)`, then
`llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/path/to/adapter"))`.
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
from core_engine.proto import LoRARequest, SamplingParams

__all__ = [
    "LLM",
    "AsyncEngineClient",
    "CompletionOutput",
    "ConfigError",
    "EngineClient",
    "EngineCoreNotFoundError",
    "EngineDeadError",
    "InvalidPromptError",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "ServiceStoppedError",
]
