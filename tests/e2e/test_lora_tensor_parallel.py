"""LoRA adapters under tensor parallelism: three CPU ranks (gloo) of the default SmolLM2, each
holding its shard of every adapter (B by output rows for qkv and gate_up, A by input columns
for o and down), give the single device's greedy tokens, which equal PEFT's
(tests/worker/test_lora_generation.py). A request naming a bad adapter gets an error on its own
and the engine keeps serving."""

from __future__ import annotations

import msgspec
import pytest

from core_engine.proto import EngineCoreRequest, FinishReason, LoRARequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.e2e.test_tensor_parallel import (
    SMOLLM2_PROMPTS,
    event_loop,
    final_output,
    running_engine,
)
from tests.helpers.engine_helpers import generate_token_ids
from tools.lora_adapters import AdapterSpec, make_peft_adapter
from tools.reference_model import converted_default_model_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoRARequest]:
    folder = tmp_path_factory.mktemp("tp-adapters")
    hf_folder = converted_default_model_folder()
    specs = [
        AdapterSpec("all", rank=8, target_modules=ALL_MODULES, seed=11),
        AdapterSpec("qv-down", rank=4, target_modules=("q_proj", "v_proj", "down_proj"), seed=12),
    ]
    for spec in specs:
        make_peft_adapter(hf_folder, spec, folder / spec.name)
    return [
        LoRARequest(spec.name, index, str(folder / spec.name))
        for index, spec in enumerate(specs, start=1)
    ]


def test_three_ranks_run_adapters_like_one_device(adapters):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        tensor_parallel_size=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    prompts = [*SMOLLM2_PROMPTS, *SMOLLM2_PROMPTS[:2]]
    lora_requests = [adapters[0], adapters[1], None, adapters[1], adapters[0]]
    bad = LoRARequest("missing", 99, "/nonexistent/adapter")

    async def scenario():
        async with running_engine(config) as (client, _):
            failed = client.add_request(
                EngineCoreRequest("bad", prompts[0], params, lora_request=bad)
            )
            queues = [
                client.add_request(EngineCoreRequest(f"r{i}", prompt, params, lora_request=lora))
                for i, (prompt, lora) in enumerate(zip(prompts, lora_requests, strict=True))
            ]
            return await final_output(failed), [await final_output(queue) for queue in queues]

    with event_loop() as loop:
        (_, bad_output), results = loop.run_until_complete(scenario())

    assert bad_output.finish_reason == FinishReason.ERROR
    assert "'missing'" in bad_output.error
    single_device = msgspec.structs.replace(config, tensor_parallel_size=1)
    expected = generate_token_ids(
        prompts, single_device, sampling_params=params, lora_requests=lora_requests
    ).results
    assert [token_ids for token_ids, _ in results] == [r.token_ids for r in expected]
    # The adapters matter: without them the same prompts give other tokens.
    base = generate_token_ids(prompts, single_device, sampling_params=params).results
    for index, lora_request in enumerate(lora_requests):
        changed = expected[index].token_ids != base[index].token_ids
        assert changed == (lora_request is not None), index
