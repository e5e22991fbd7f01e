"""Greedy generation through LoRA adapters, engine vs transformers + PEFT, token for token.

Three adapters of the default model made here with PEFT (random non-zero A and B; ranks 4, 8
and 16; different target modules; one rsLoRA) and the base model run mixed in one continuously
batched workload, float32 like the reference. The worker holds two adapter slots and keeps two
adapters in host memory, so a third adapter waits for a slot, evicts one and reloads: chunked
prompts, prefix hits within an adapter and preemption must all give PEFT's tokens.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.core.in_process_engine import GenerationOutput
from core_engine.proto import LoRARequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.worker import Worker
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import hf_greedy
from tools.lora_adapters import AdapterSpec, make_peft_adapter
from tools.reference_model import converted_default_model_folder

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 16
MAX_MODEL_LEN = 256
MAX_LORAS = 2
SHARED_PREFIX = (
    "You are a careful assistant. Answer in plain English, keep every answer short, and never "
    "invent facts. "
)
PROMPTS = [
    "The capital of France is",
    SHARED_PREFIX + "Question: what is the boiling point of water?",
    SHARED_PREFIX + "Question: why is the sky blue?",
]
ADAPTERS = [
    AdapterSpec("attention-qv", rank=8, target_modules=("q_proj", "v_proj"), seed=1),
    AdapterSpec(
        "everything-rslora",
        rank=16,
        lora_alpha=8.0,
        use_rslora=True,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        seed=2,
    ),
    AdapterSpec(
        "mlp-and-o", rank=4, target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"), seed=3
    ),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the other parity modules (two that wait on each other on a
    shared 2-core machine run far slower than one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_folder():
    return converted_default_model_folder()


@pytest.fixture(scope="module")
def prompt_token_ids(hf_folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    return [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def adapters(hf_folder, prompt_token_ids, tmp_path_factory):
    """(LoRARequest, PEFT's greedy tokens per prompt) per adapter, and the base model's."""
    folder = tmp_path_factory.mktemp("adapters")
    made = []
    for lora_id, spec in enumerate(ADAPTERS, start=1):
        model = make_peft_adapter(hf_folder, spec, folder / spec.name)
        with torch.no_grad():
            expected = [hf_greedy(model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]
        made.append((LoRARequest(spec.name, lora_id, str(folder / spec.name)), expected))
    return made


@pytest.fixture(scope="module")
def base_tokens(hf_folder, prompt_token_ids) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf_greedy(model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]


@pytest.fixture(scope="module")
def worker() -> Worker:
    w = Worker(
        EngineConfig(
            model=None,
            device="cpu",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            enable_lora=True,
            max_loras=MAX_LORAS,
            max_lora_rank=16,
        )
    )
    w.load_model()
    return w


def mixed_workload(adapters, base_tokens, prompt_token_ids):
    """Every prompt under every adapter and under the base model, interleaved so that one
    step holds several adapters: (prompts, lora requests, expected tokens)."""
    prompts, lora_requests, expected = [], [], []
    for index, ids in enumerate(prompt_token_ids):
        for lora_request, adapter_tokens in [*adapters, (None, base_tokens)]:
            prompts.append(ids)
            lora_requests.append(lora_request)
            expected.append(adapter_tokens[index])
    return prompts, lora_requests, expected


def run(worker, prompts, lora_requests, **options) -> GenerationOutput:
    config = EngineConfig(
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        enable_lora=True,
        max_loras=MAX_LORAS,
        max_lora_rank=16,
        **options,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return generate_token_ids(
        prompts, config, sampling_params=params, worker=worker, lora_requests=lora_requests
    )


def assert_same_tokens(output: GenerationOutput, lora_requests, expected) -> None:
    for index, (result, want) in enumerate(zip(output.results, expected, strict=True)):
        name = lora_requests[index].lora_name if lora_requests[index] else "base"
        assert result.token_ids == want, f"request {index} ({name}) diverged"


def test_every_adapter_changes_the_base_model_s_tokens(adapters, base_tokens):
    for lora_request, adapter_tokens in adapters:
        assert adapter_tokens != base_tokens, lora_request.lora_name


def test_mixed_adapters_and_base_model_match_peft(worker, adapters, base_tokens, prompt_token_ids):
    prompts, lora_requests, expected = mixed_workload(adapters, base_tokens, prompt_token_ids)
    output = run(
        worker,
        prompts,
        lora_requests,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=200,
        enable_prefix_caching=False,
    )
    assert_same_tokens(output, lora_requests, expected)
    # Three adapters over two slots and two host entries: some were evicted and reloaded.
    assert len(worker.lora_manager.host_cache) == MAX_LORAS


def test_chunked_prompts_prefix_hits_and_preemption_match_peft(
    worker, adapters, base_tokens, prompt_token_ids
):
    prompts, lora_requests, expected = mixed_workload(adapters, base_tokens, prompt_token_ids)
    min_blocks = MAX_MODEL_LEN // worker.block_size + 1
    output = run(
        worker,
        prompts,
        lora_requests,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=min_blocks + 4,
    )
    assert output.stats.prefix_cache_hits > 0  # the shared prefix, within each adapter
    assert output.stats.num_preemptions > 0
    assert_same_tokens(output, lora_requests, expected)
