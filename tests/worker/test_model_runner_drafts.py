"""ModelRunner verifying draft tokens (speculative decoding) with the tiny attention model.

A driver plays the engine core's part: it sends each request once, then the tokens the worker
returned and a `num_computed_tokens` rolled back to the tokens kept, so the KV written at
rejected positions is overwritten later, as the real scheduler does. Every result is checked
against one-token-at-a-time decoding: the cache-free dense model for plain greedy, the runner
itself without drafts where sampling parameters shape the distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from core_engine.proto import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from core_engine.worker.model_runner import ModelRunner
from tests.helpers.tiny_causal_lm import MAX_MODEL_LEN, VOCAB, TinyCausalLM
from tests.worker.test_model_runner import BLOCK_SIZE, random_prompts

BLOCKS_PER_REQUEST = MAX_MODEL_LEN // BLOCK_SIZE
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return TinyCausalLM()


def make_runner(model, num_requests: int = 1, eos_token_ids=(), seed: int = 0) -> ModelRunner:
    """A runner with BLOCKS_PER_REQUEST blocks for each of `num_requests` requests."""
    runner = ModelRunner(
        model,
        device=torch.device("cpu"),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_reqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        eos_token_ids=eos_token_ids,
        seed=seed,
    )
    num_blocks = 1 + num_requests * BLOCKS_PER_REQUEST
    shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    runner.initialize_kv_cache([torch.full(shape, float("nan")) for _ in range(model.num_layers)])
    return runner


class LogitsRecorder:
    """The model, keeping the logits of the last `compute_logits` call."""

    def __init__(self, model: TinyCausalLM) -> None:
        self.model = model
        self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
        self.head_dim = model.head_dim
        self.last_logits: torch.Tensor | None = None

    def forward(self, *args):
        return self.model.forward(*args)

    def compute_logits(self, hidden_states):
        self.last_logits = self.model.compute_logits(hidden_states)
        return self.last_logits


@dataclass
class DriverRequest:
    prompt: list[int]
    params: SamplingParams
    first_block: int
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # returned, not yet sent back
    num_computed: int = 0
    sent: bool = False

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output


class Driver:
    """Plays the engine core for one ModelRunner (no budget, no stops: the test picks every
    step's chunks and drafts)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.requests: dict[str, DriverRequest] = {}

    def add(self, req_id: str, prompt: list[int], **params) -> None:
        params = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True, **params}
        first_block = 1 + BLOCKS_PER_REQUEST * len(self.requests)
        self.requests[req_id] = DriverRequest(prompt, SamplingParams(**params), first_block)

    def step(self, chunks=None, drafts=None):
        """`chunks[req_id]` tokens for requests without drafts, 1 + K for those with K drafts;
        returns the ModelRunnerOutput."""
        chunks, drafts = dict(chunks or {}), dict(drafts or {})
        num_scheduled = {**chunks, **{r: 1 + len(d) for r, d in drafts.items()}}
        new, cached = [], []
        for req_id in num_scheduled:
            request = self.requests[req_id]
            if not request.sent:
                blocks = list(range(request.first_block, request.first_block + BLOCKS_PER_REQUEST))
                new.append(
                    NewRequestData(
                        req_id, request.prompt, request.params, [blocks], request.num_computed
                    )
                )
                request.sent = True
            else:
                cached.append(
                    CachedRequestData(req_id, request.num_computed, new_token_ids=request.unsent)
                )
                request.unsent = []
        output = self.runner.execute_model(
            SchedulerOutput(
                scheduled_new_reqs=new,
                scheduled_cached_reqs=cached,
                num_scheduled_tokens=num_scheduled,
                total_num_scheduled_tokens=sum(num_scheduled.values()),
                scheduled_spec_decode_tokens=drafts,
            )
        )
        for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = self.requests[req_id]
            request.num_computed += num_scheduled[req_id]
            if token_ids:
                request.output += token_ids
                request.unsent += token_ids
                # All but the newest token are computed; rejected positions are recomputed.
                request.num_computed = len(request.history) - 1
        return output


def prefill(driver: Driver, req_id: str) -> list[int]:
    request = driver.requests[req_id]
    output = driver.step(chunks={req_id: len(request.prompt)})
    return output.sampled_token_ids[output.req_ids.index(req_id)]


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def drafts_matching(reference: list[int], start: int, num_drafts: int, num_matching: int):
    """`num_matching` tokens of the reference from `start`, then tokens that differ from it."""
    drafts = reference[start : start + num_matching]
    drafts += [wrong(t) for t in reference[start + num_matching : start + num_drafts]]
    return drafts + [0] * (num_drafts - len(drafts))  # past the reference: anything


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4])
def test_greedy_verification_returns_the_one_at_a_time_greedy_tokens(model, num_drafts):
    """Each step accepts 0..K drafts in turn (partial and full acceptance): the tokens are the
    dense model's greedy ones, also after KV written at rejected positions was overwritten."""
    prompt = random_prompts([9], seed=4)[0]
    reference = model.dense_greedy(prompt, NUM_NEW_TOKENS + num_drafts + 1)
    driver = Driver(make_runner(model))
    driver.add("a", prompt)
    assert prefill(driver, "a") == reference[:1]
    step = 0
    request = driver.requests["a"]
    while len(request.output) < NUM_NEW_TOKENS:
        num_matching = step % (num_drafts + 1)
        start = len(request.output)
        drafts = drafts_matching(reference, start, num_drafts, num_matching)
        output = driver.step(drafts={"a": drafts})
        assert output.sampled_token_ids == [reference[start : start + num_matching + 1]], step
        step += 1


def test_verified_logits_equal_a_cache_free_run_at_every_position(model):
    recorder = LogitsRecorder(model)
    prompt = random_prompts([7], seed=5)[0]
    driver = Driver(make_runner(recorder))
    driver.add("a", prompt)
    prefill(driver, "a")
    history = driver.requests["a"].history
    drafts = [3, 17, 17, 40]
    driver.step(drafts={"a": drafts})
    expected = torch.stack(
        [model.dense_next_token_logits(history + drafts[:j]) for j in range(len(drafts) + 1)]
    )
    torch.testing.assert_close(recorder.last_logits, expected, atol=1e-4, rtol=1e-4)


def test_drafts_beside_decodes_and_prefill_chunks_keep_every_request_greedy(model):
    """One step holds a request verifying drafts, a plain decode, a prompt chunk that does not
    sample and one that finishes its prompt; batch rows move as requests come and go."""
    prompts = random_prompts([6, 5, 13, 8], seed=7)
    references = [model.dense_greedy(p, 12) for p in prompts]
    driver = Driver(make_runner(model, num_requests=4))
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt)
    driver.step(chunks={"r0": 6, "r1": 5})
    output = driver.step(
        chunks={"r1": 1, "r2": 8, "r3": 8},
        drafts={"r0": drafts_matching(references[0], 1, 3, 2)},
    )
    assert dict(zip(output.req_ids, output.sampled_token_ids, strict=True)) == {
        "r0": references[0][1:4],
        "r1": references[1][1:2],
        "r2": [],
        "r3": references[3][:1],
    }
    # r1 sits this step out: its row is freed and the batch condensed.
    driver.step(chunks={"r2": 5, "r0": 1}, drafts={"r3": drafts_matching(references[3], 1, 4, 4)})
    assert len(driver.requests["r3"].output) == 6
    driver.step(chunks={"r1": 1}, drafts={"r2": drafts_matching(references[2], 1, 2, 0), "r0": [0]})
    for i, request in enumerate(driver.requests.values()):
        assert len(request.output) >= 2
        assert request.output == references[i][: len(request.output)], i


def one_at_a_time(model, prompt, num_tokens, eos_token_ids=(), **params) -> list[int]:
    """The runner's own tokens without drafts (its sampling parameters tested elsewhere)."""
    driver = Driver(make_runner(model, eos_token_ids=eos_token_ids))
    driver.add("a", prompt, **params)
    prefill(driver, "a")
    while len(driver.requests["a"].output) < num_tokens:
        driver.step(chunks={"a": 1})
    return driver.requests["a"].output[:num_tokens]


PROMPT = [5, 6, 7, 5, 6, 7, 5, 9]


def parameter_cases(plain: list[int]) -> dict[str, tuple[dict, list[int]]]:
    """Parameters (and eos ids) that change the greedy tokens of PROMPT, each at a verified
    position: built from the plain greedy tokens so that each rule has something to act on."""
    return {
        "repetition": ({"repetition_penalty": 1.8}, []),
        "frequency+presence": ({"frequency_penalty": 2.0, "presence_penalty": 0.5}, []),
        "logit-bias": ({"logit_bias": {plain[2]: -100.0, 30: 4.0}}, []),
        "min-tokens": (
            {"min_tokens": 6, "stop_token_ids": [plain[4]], "ignore_eos": False},
            [plain[2]],
        ),
        "bad-words": ({"bad_words_token_ids": [[plain[2], plain[3]], [plain[5]]]}, []),
    }


@pytest.mark.parametrize(
    "case", ["repetition", "frequency+presence", "logit-bias", "min-tokens", "bad-words"]
)
def test_sampling_parameters_act_at_every_verified_position_as_one_at_a_time(model, case):
    """Drafts from the true (parameter-shaped) continuation are all accepted; drafts from the
    plain model's greedy continuation are rejected where the rule changes the token; both give
    exactly the one-at-a-time tokens."""
    num_tokens = 14
    plain = model.dense_greedy(PROMPT, num_tokens)
    params, eos_token_ids = parameter_cases(plain)[case]
    reference = one_at_a_time(model, PROMPT, num_tokens, eos_token_ids, **params)
    assert reference != plain  # the rule changes something
    for drafter in ("reference", "plain-model"):
        driver = Driver(make_runner(model, eos_token_ids=eos_token_ids))
        driver.add("a", PROMPT, **params)
        prefill(driver, "a")
        request = driver.requests["a"]
        while len(request.output) < num_tokens:
            if drafter == "reference":
                drafts = reference[len(request.output) : len(request.output) + 3] or [0]
            else:
                drafts = model.dense_greedy(request.history, 3)
            driver.step(drafts={"a": drafts})
        assert request.output[:num_tokens] == reference, drafter


def test_a_seeded_request_reproduces_its_verified_tokens(model):
    prompt = random_prompts([6], seed=8)[0]

    def run(sampler_seed: int) -> list[int]:
        driver = Driver(make_runner(model, seed=sampler_seed))
        driver.add("a", prompt, temperature=1.0, seed=5)
        prefill(driver, "a")
        request = driver.requests["a"]
        while len(request.output) < NUM_NEW_TOKENS:
            driver.step(drafts={"a": model.dense_greedy(request.history, 3)})
        return request.output[:NUM_NEW_TOKENS]

    first = run(sampler_seed=0)
    assert first == run(sampler_seed=1)
    assert first != model.dense_greedy(prompt, NUM_NEW_TOKENS)  # really sampled


def test_logprobs_of_verified_tokens_are_those_of_their_positions(model):
    prompt = random_prompts([5], seed=9)[0]
    reference = model.dense_greedy(prompt, 6)
    driver = Driver(make_runner(model))
    driver.add("a", prompt, logprobs=2)
    prefill(driver, "a")
    output = driver.step(drafts={"a": drafts_matching(reference, 1, 3, 1)})
    (tokens,), (entries,) = output.sampled_token_ids, output.logprobs
    assert tokens == reference[1:3] and len(entries) == 2
    for j, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        logprobs = torch.log_softmax(model.dense_next_token_logits(prompt + reference[: 1 + j]), -1)
        assert entry.sampled_logprob == pytest.approx(float(logprobs[token]), abs=1e-4)
        assert entry.top_token_ids == logprobs.topk(2).indices.tolist()


def test_drafts_must_be_verified_in_full_this_step(model):
    driver = Driver(make_runner(model))
    driver.add("a", [1, 2, 3])
    prefill(driver, "a")
    request = driver.requests["a"]
    cached = CachedRequestData("a", 3, new_token_ids=request.unsent)
    too_short = SchedulerOutput(
        scheduled_cached_reqs=[cached],
        num_scheduled_tokens={"a": 2},
        total_num_scheduled_tokens=2,
        scheduled_spec_decode_tokens={"a": [4, 5]},
    )
    with pytest.raises(
        ValueError,
        match="'a' verifies 2 drafts, so it must be scheduled for at "
        "least 3 tokens ending at token 6; it is scheduled for 2 ending at token 5",
    ):
        driver.runner.execute_model(too_short)
    from_the_first_draft = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", 4)],
        num_scheduled_tokens={"a": 2},
        total_num_scheduled_tokens=2,
        scheduled_spec_decode_tokens={"a": [4, 5]},
    )
    with pytest.raises(
        ValueError,
        match="at least 3 tokens ending at token 6; it is scheduled for 2 ending at token 6",
    ):
        driver.runner.execute_model(from_the_first_draft)


def test_drafts_past_max_model_len_are_refused(model):
    driver = Driver(make_runner(model))
    prompt = [1] * (MAX_MODEL_LEN - 2)
    driver.add("a", prompt)
    prefill(driver, "a")
    with pytest.raises(ValueError, match="with 2 drafts would reach 65 tokens, more than max"):
        driver.step(drafts={"a": [4, 5]})
