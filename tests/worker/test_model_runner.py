"""ModelRunner with a tiny random attention model, driven by the real core Scheduler.

Every engine run is checked against a dense, cache-free recomputation of the same model, so
chunked prefill, preemption with recompute, prefix-cache hits and batch reshuffles must all
leave the greedy tokens unchanged.
"""

import pytest
import torch

from core_engine.core.in_process_engine import make_requests, run_requests
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from core_engine.worker.model_runner import ModelRunner
from tests.helpers.tiny_causal_lm import MAX_MODEL_LEN, VOCAB, TinyCausalLM

CPU = torch.device("cpu")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return TinyCausalLM()


def make_runner(model, num_blocks: int, max_num_batched_tokens: int = 64, max_num_reqs: int = 8):
    runner = ModelRunner(
        model,
        device=CPU,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    runner.initialize_kv_cache([torch.full(shape, float("nan")) for _ in range(model.num_layers)])
    return runner


def run_engine(
    model, prompts, *, num_blocks=256, budget=64, max_num_seqs=8, caching=True, params=None
):
    params = params or SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=caching,
    )
    runner = make_runner(
        model, num_blocks, max_num_batched_tokens=budget, max_num_reqs=max_num_seqs
    )
    requests = make_requests(prompts, params, eos_token_ids=(), block_size=BLOCK_SIZE)
    return run_requests(Scheduler(config), runner, requests)


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPT_LENGTHS = [1, 3, 4, 5, 9, 17, 30, 12]


def test_continuous_batching_matches_dense_greedy(model):
    prompts = random_prompts(PROMPT_LENGTHS)
    output = run_engine(model, prompts, budget=64)
    expected = [model.dense_greedy(p, 10) for p in prompts]
    assert [r.token_ids for r in output.results] == expected
    assert all(r.finish_reason == "length" for r in output.results)


def test_small_budget_chunks_prompts_without_changing_tokens(model):
    prompts = random_prompts(PROMPT_LENGTHS)
    expected = [model.dense_greedy(p, 10) for p in prompts]
    for budget in (5, 7, 16):
        output = run_engine(model, prompts, budget=budget)
        assert [r.token_ids for r in output.results] == expected, f"budget {budget}"


def test_preemption_and_resume_keep_tokens(model):
    prompts = random_prompts(PROMPT_LENGTHS)
    expected = [model.dense_greedy(p, 10) for p in prompts]
    output = run_engine(model, prompts, num_blocks=18, budget=16)
    assert output.stats.num_preemptions > 0
    assert [r.token_ids for r in output.results] == expected


def test_prefix_cache_hits_keep_tokens(model):
    shared = random_prompts([13], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts([2, 5, 1, 7], seed=6)]
    expected = [model.dense_greedy(p, 10) for p in prompts]
    output = run_engine(model, prompts, budget=8, max_num_seqs=2)
    assert output.stats.prefix_cache_hits > 0
    assert [r.token_ids for r in output.results] == expected


def test_seeded_sampling_is_batch_invariant(model):
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    target = random_prompts([6], seed=9)[0]
    alone = run_engine(model, [target], params=params).results[0].token_ids
    others = random_prompts([3, 20, 11], seed=10)
    mixed = run_engine(model, [*others[:2], target, others[2]], params=params, budget=9)
    assert mixed.results[2].token_ids == alone
    greedy = model.dense_greedy(target, 12)
    assert alone != greedy  # the sampled run really sampled


def step(new=(), cached=(), num_scheduled=None, finished=()):
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=list(finished),
    )


def new_req(req_id, prompt, block_ids, num_computed=0, **params):
    params = {"temperature": 0.0, **params}
    return NewRequestData(req_id, prompt, SamplingParams(**params), [block_ids], num_computed)


def test_mid_prefill_requests_get_empty_samples_and_logprobs_only_when_asked(model):
    runner = make_runner(model, num_blocks=16)
    out = runner.execute_model(
        step(
            new=[new_req("a", [1, 2, 3, 4, 5, 6], [1, 2]), new_req("b", [7, 8], [3], logprobs=2)],
            num_scheduled={"a": 4, "b": 2},
        )
    )
    assert out.req_ids == ["a", "b"]
    assert out.sampled_token_ids[0] == []
    assert len(out.sampled_token_ids[1]) == 1
    assert out.logprobs[0] is None and len(out.logprobs[1][0].top_token_ids) == 2

    sampled_b = out.sampled_token_ids[1]
    out = runner.execute_model(
        step(
            cached=[CachedRequestData("a", 4), CachedRequestData("b", 2, new_token_ids=sampled_b)],
            num_scheduled={"a": 2, "b": 1},
        )
    )
    assert out.sampled_token_ids[0] == model.dense_greedy([1, 2, 3, 4, 5, 6], 1)
    assert out.sampled_token_ids[1] == model.dense_greedy([7, 8], 2)[1:]


def test_unscheduled_request_leaves_batch_and_finished_request_is_forgotten(model):
    runner = make_runner(model, num_blocks=16)
    runner.execute_model(
        step(
            new=[new_req("a", [1, 2], [1]), new_req("b", [3], [2])], num_scheduled={"a": 2, "b": 1}
        )
    )
    out = runner.execute_model(
        step(
            cached=[CachedRequestData("b", 1, new_token_ids=[5])],
            num_scheduled={"b": 1},
            finished=["a"],
        )
    )
    assert out.req_ids == ["b"]
    assert "a" not in runner.requests
    assert runner.input_batch.req_ids[0] == "b"


def test_cached_request_never_seen_raises(model):
    runner = make_runner(model, num_blocks=16)
    with pytest.raises(ValueError, match="'ghost' was scheduled as cached but"):
        runner.execute_model(
            step(cached=[CachedRequestData("ghost", 0)], num_scheduled={"ghost": 1})
        )


def test_scheduling_unknown_tokens_raises(model):
    runner = make_runner(model, num_blocks=16)
    with pytest.raises(ValueError, match="scheduled up to token 3 but holds only 2 tokens"):
        runner.execute_model(step(new=[new_req("a", [1, 2], [1])], num_scheduled={"a": 3}))


def test_too_many_tokens_for_the_buffers_raises(model):
    runner = make_runner(model, num_blocks=16, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="5 tokens, more than max_num_batched_tokens=4"):
        runner.execute_model(
            step(new=[new_req("a", [1, 2, 3, 4, 5], [1, 2])], num_scheduled={"a": 5})
        )


def test_dummy_forward_fills_scratch_cache_without_touching_requests(model):
    runner = make_runner(model, num_blocks=4)
    shape = (2, 40, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    scratch = [torch.full(shape, float("nan")) for _ in range(model.num_layers)]
    runner.dummy_forward(150, scratch)
    slots = scratch[0].flatten(1, 2)  # [2, num_slots, heads, dim]; requests fill slots in order
    assert not torch.isnan(slots[:, :150]).any()
    assert torch.isnan(slots[:, 150:]).all()
    assert runner.requests == {} and runner.input_batch.num_reqs == 0


def test_every_eos_id_stops_unless_ignore_eos(model):
    prompt = random_prompts([7], seed=3)[0]
    expected = model.dense_greedy(prompt, 10)
    second_eos = expected[4]
    stop_at = expected.index(second_eos) + 1
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_gpu_blocks=64)
    for ignore_eos, num_tokens, reason in ((False, stop_at, "stop"), (True, 10, "length")):
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=ignore_eos)
        requests = make_requests(
            [prompt], params, eos_token_ids=(VOCAB + 1, second_eos), block_size=BLOCK_SIZE
        )
        result = run_requests(Scheduler(config), make_runner(model, 64), requests).results[0]
        assert result.token_ids == expected[:num_tokens]
        assert result.finish_reason == reason
