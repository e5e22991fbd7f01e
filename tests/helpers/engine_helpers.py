"""The engine in the test process: `InProcessEngine` over a `LocalExecutor`, in one call."""

from __future__ import annotations

from collections.abc import Sequence

from core_engine.common.model_files import resolve_model_path
from core_engine.core.in_process_engine import GenerationOutput, InProcessEngine
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import LoRARequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.local_executor import LocalExecutor


def in_process_engine(config: EngineConfig | None = None, worker=None) -> InProcessEngine:
    """An engine for `config` over `worker` (loaded), or over a worker it loads."""
    config = config or EngineConfig()
    return InProcessEngine(config, LocalExecutor(config, worker))


def generate_token_ids(
    prompt_token_ids: Sequence[Sequence[int]],
    config: EngineConfig | None = None,
    *,
    sampling_params: SamplingParams | None = None,
    worker=None,
    lora_requests: Sequence[LoRARequest | None] | None = None,
) -> GenerationOutput:
    """Runs token-id prompts as one workload (greedy, 32 tokens unless `sampling_params`),
    each through its adapter in `lora_requests` (an engine with enable_lora)."""
    sampling_params = sampling_params or SamplingParams(temperature=0.0, max_tokens=32)
    return in_process_engine(config, worker).generate(
        prompt_token_ids, sampling_params, lora_requests=lora_requests
    )


def generate(
    prompts: Sequence[str], config: EngineConfig, *, sampling_params: SamplingParams
) -> GenerationOutput:
    """Text prompts through the model's own tokenizer (no chat template), one workload."""
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    return in_process_engine(config).generate_text(prompts, tokenizer, sampling_params)
