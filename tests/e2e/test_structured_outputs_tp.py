"""Structured outputs across the process split: three tensor-parallel worker processes of the
default SmolLM2 compile grammars before their requests run, rank 0's report decides for every
rank, and a grammar that fails to compile fails only its request."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest

from core_engine.common.model_files import resolve_model_path
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.sampling_params import StructuredOutputs
from tests.e2e.test_tensor_parallel import event_loop, running_engine
from tests.worker.test_structured_outputs import PERSON, SLOW_SCHEMA

pytestmark = pytest.mark.timeout(300)

# The slow schema compiles on every rank at once: on a loaded 2-core machine, a minute or so.
OUTPUT_TIMEOUT_S = 150.0


@pytest.mark.slow
def test_three_ranks_run_other_requests_while_a_grammar_compiles_and_fail_only_a_bad_one():
    """A free request finishes before a request whose schema takes seconds to compile gets its
    first token (before, the step that first sampled it waited for the compile, free request
    included); a constrained output validates; a grammar that does not compile fails alone."""
    tokenizer = load_tokenizer(resolve_model_path(None))
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        tensor_parallel_size=3,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_gpu_blocks_override=64,
    )
    person = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        structured_outputs=StructuredOutputs(json=json.dumps(PERSON)),
    )
    slow = SamplingParams(
        max_tokens=3, structured_outputs=StructuredOutputs(json=json.dumps(SLOW_SCHEMA))
    )
    bad = SamplingParams(max_tokens=5)
    bad.structured_outputs = StructuredOutputs(regex="(unclosed")  # built past the frontend
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = tokenizer.encode("Describe a person as JSON:")
    id_to_params = {"slow": slow, "person": person, "bad": bad, "free": free}

    async def scenario():
        async with running_engine(config) as (client, _):
            queues = [
                client.add_request(EngineCoreRequest(request_id, prompt, params, eos_token_id=2))
                for request_id, params in id_to_params.items()
            ]
            return await asyncio.gather(*(timed_outputs(queue) for queue in queues))

    with event_loop() as loop:
        results = dict(zip(id_to_params, loop.run_until_complete(scenario()), strict=True))
    (free_end_s, free_out), (slow_start_s, _) = results["free"][-1], results["slow"][0]
    assert free_out.finish_reason == FinishReason.LENGTH
    assert free_end_s < slow_start_s
    assert [out.finish_reason for _, out in results["slow"]][-1] == FinishReason.LENGTH
    person_ids = [t for _, out in results["person"] for t in out.new_token_ids]
    assert results["person"][-1][1].finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(tokenizer.decode(person_ids)), PERSON)
    ((_, bad_out),) = results["bad"]
    assert bad_out.finish_reason == FinishReason.ERROR
    assert "structured_outputs" in bad_out.error and "parenthesis" in bad_out.error


async def timed_outputs(queue: asyncio.Queue) -> list[tuple[float, EngineCoreOutput]]:
    """(arrival time, output) of every output of one request, up to its finished one."""
    timed = []
    while True:
        item = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
        if isinstance(item, Exception):
            raise item
        timed.append((time.monotonic(), item))
        if item.finished:
            return timed
