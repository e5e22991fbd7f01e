"""LLM, EngineClient and AsyncEngineClient against a real engine core running the null model.

The null worker samples token 42 ("*" in the byte tokenizer) every step, so expected texts
are runs of "*".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest

from core_engine.frontend import (
    LLM,
    AsyncEngineClient,
    EngineClient,
    EngineDeadError,
    SamplingParams,
    ServiceStoppedError,
)
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.engine_death import (
    assert_cut_off_outputs,
    engine_worker_pids,
    kill_once_generating,
)

NULL_TOKEN_TEXT = "*"
TOKENIZER = NullTokenizer()


@pytest.fixture(scope="module")
def llm():
    # Two sequences at a time, so requests finish in a different order than submitted.
    with LLM(model="null", max_num_seqs=2, max_model_len=256) as llm:
        yield llm


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["first", [7, 8, 9], "third prompt", "4"]
    max_tokens = [9, 1, 5, 3]
    params = [SamplingParams(max_tokens=n) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == ["first", None, "third prompt", "4"]
    assert [o.prompt_token_ids for o in outputs] == [
        TOKENIZER.encode("first"),
        [7, 8, 9],
        TOKENIZER.encode("third prompt"),
        TOKENIZER.encode("4"),
    ]
    for output, n in zip(outputs, max_tokens, strict=True):
        (completion,) = output.outputs
        assert completion.text == NULL_TOKEN_TEXT * n
        assert completion.token_ids == [42] * n
        assert completion.finish_reason == "length"
        assert output.finished and output.num_generated_tokens == n


def test_generate_accepts_one_prompt_and_shows_progress(llm, capsys):
    (output,) = llm.generate("hello", SamplingParams(max_tokens=2))
    assert output.outputs[0].text == "**"
    assert "Processed prompts" in capsys.readouterr().err
    (output,) = llm.generate([1, 2, 3], SamplingParams(max_tokens=1), use_tqdm=False)
    assert output.prompt_token_ids == [1, 2, 3]


def test_generate_rejects_bad_input_before_running_anything(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: .*max_tokens may be at most 254"):
        llm.generate(["a", "bb"], SamplingParams(max_tokens=255), use_tqdm=False)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        llm.generate([[1, 99999]], use_tqdm=False)
    params = SamplingParams(min_tokens=1, stop_token_ids=[32000])
    with pytest.raises(
        ValueError, match="stop_token_ids must name token ids below the vocabulary size 32000"
    ):
        llm.generate([[1, 2]], params, use_tqdm=False)
    assert llm._client.get_stats().num_waiting_reqs == 0
    assert llm._client.get_stats().num_running_reqs == 0


def test_n_choices_and_stop_strings(llm):
    (output,) = llm.generate(
        "x", SamplingParams(n=3, seed=1, max_tokens=10, min_tokens=5, stop=["**"]), use_tqdm=False
    )
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for completion in output.outputs:
        # Stop strings count only from min_tokens on; the match is cut from the text.
        assert completion.text == "***"
        assert len(completion.token_ids) == 5
        assert completion.finish_reason == "stop"
        assert completion.stop_reason == "**"
    assert output.num_generated_tokens == 15
    stats = llm._client.get_stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_chat_uses_the_chat_template(llm):
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    (output,) = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt_token_ids == TOKENIZER.encode("system: be brief\nuser: hi\nassistant: ")
    assert output.outputs[0].text == "**"
    outputs = llm.chat([conversation, conversation[1:]], use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outputs] == [37, 20]


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(llm):
    prompt = list(range(1, 41))  # two full blocks of 16
    params = SamplingParams(max_tokens=2)
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_engine_client_streams_deltas_and_aborts_a_closed_stream():
    with EngineClient(EngineConfig(model="null", max_model_len=4096)) as client:
        deltas = list(client.generate("hi", SamplingParams(max_tokens=6)))
        assert "".join(d.outputs[0].text for d in deltas) == "******"
        assert [d.finished for d in deltas] == [False] * 5 + [True]

        stream = client.generate("hi", SamplingParams(max_tokens=4000))
        next(stream)
        assert client.get_stats().num_running_reqs == 1
        stream.close()
        stats = wait_for_stats(client, lambda s: s.num_running_reqs == 0)
        assert stats.kv_cache_usage == 0.0


def wait_for_stats(client, condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get_stats()
        if condition(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_async_engine_client_abort_and_dead_engine():
    async def scenario() -> None:
        engine = AsyncEngineClient(EngineConfig(model="null", max_model_len=4096))
        async with engine:
            stream = engine.generate("hi", SamplingParams(max_tokens=4000), request_id="r1")
            first = await stream.__anext__()
            assert first.request_id == "r1" and first.outputs[0].text == "*"
            with pytest.raises(ValueError, match="'r1' is already running"):
                engine.generate("again", request_id="r1")
            await engine.abort("r1")
            rest = [output async for output in stream]
            assert rest[-1].finished
            assert rest[-1].outputs[0].finish_reason == "abort"
            await engine.check_health()
            stats = await engine.get_stats()
            assert stats.num_running_reqs == 0
        with pytest.raises(EngineDeadError):
            engine.generate("after shutdown")
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(scenario())


def test_stop_serving_ends_running_requests_and_refuses_new_ones_but_the_engine_runs_on():
    async def scenario() -> None:
        async with AsyncEngineClient(EngineConfig(model="null", max_model_len=4096)) as engine:
            streams = [engine.generate("hi", SamplingParams(max_tokens=4000, n=n)) for n in (1, 3)]
            for stream in streams:
                await stream.__anext__()
            assert engine.num_running_requests == 2
            await engine.stop_serving("maintenance")
            for stream in streams:
                with pytest.raises(ServiceStoppedError, match="maintenance"):
                    async for _ in stream:
                        pass
            assert engine.num_running_requests == 0
            with pytest.raises(ServiceStoppedError, match="maintenance"):
                engine.generate("after")
            # The core freed every block and still answers.
            await engine.check_health()
            stats = await engine.get_stats()
            assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0

    asyncio.run(scenario())


def test_wait_until_dead_returns_the_reason_once_the_core_dies():
    async def scenario() -> None:
        async with AsyncEngineClient(EngineConfig(model="null")) as engine:
            waiter = asyncio.ensure_future(engine.wait_until_dead())
            await asyncio.sleep(0.2)
            assert not waiter.done()
            os.kill(engine._core.core_pid, signal.SIGKILL)
            reason = await asyncio.wait_for(waiter, 10)
            assert "signal SIGKILL" in reason
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                engine.generate("after")

    asyncio.run(scenario())


def test_a_worker_killed_during_generate_raises_engine_dead_carrying_the_outputs_so_far():
    """Not a normal return with cut-off outputs (a batch script would take them for results):
    EngineDeadError, whose `outputs` hold every prompt's tokens so far, in input order."""
    prompts = ["first", [5, 6, 7], "third", "4"]
    with LLM(model="null", max_num_seqs=4, max_model_len=100_000) as llm:
        (worker_pid,) = engine_worker_pids(llm)
        killer = kill_once_generating(
            llm, len(prompts), lambda: os.kill(worker_pid, signal.SIGKILL)
        )
        with pytest.raises(EngineDeadError) as dead:
            llm.generate(prompts, SamplingParams(max_tokens=90_000), use_tqdm=False)
        killer.join()
        assert killer.saw_generating
        assert f"worker rank 0 (pid {worker_pid}) died (signal SIGKILL)" in dead.value.reason
        assert_cut_off_outputs(dead.value, prompts, token_id=42)
        with pytest.raises(EngineDeadError):
            llm.generate("after", use_tqdm=False)


def test_a_stream_of_engine_client_raises_engine_dead_carrying_its_output_so_far():
    with EngineClient(EngineConfig(model="null", max_model_len=100_000)) as client:
        stream = client.generate("hi", SamplingParams(max_tokens=90_000))
        first = next(stream)
        assert first.outputs[0].token_ids == [42]
        os.kill(client.engine._core.core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="SIGKILL") as dead:
            for _ in stream:
                pass
        (output,) = dead.value.outputs
        assert output.finished and output.outputs[0].finish_reason == "error"
        assert len(output.outputs[0].token_ids) >= 1  # the whole completion so far, not a delta
        assert output.outputs[0].text == NULL_TOKEN_TEXT * len(output.outputs[0].token_ids)


@contextlib.contextmanager
def keyboard_interrupt_on_sigint():
    """SIGINT raising KeyboardInterrupt, as in an interactive Python, whatever pytest inherited:
    started in the background by a shell without job control (`cmd &`) or under nohup, it gets
    SIGINT ignored, and Python then installs no handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_long_generate(llm: LLM, interrupt: threading.Timer) -> None:
    """Starts `interrupt` (a timer that sends SIGINT) and runs a generation far longer than it
    waits, which must end in KeyboardInterrupt."""
    interrupt.start()
    try:
        with keyboard_interrupt_on_sigint(), pytest.raises(KeyboardInterrupt):
            llm.generate(["x"] * 2, SamplingParams(max_tokens=60000), use_tqdm=False)
    finally:
        interrupt.cancel()


def assert_no_request_left_running(llm: LLM) -> None:
    """The engine runs no request within 10 s (the interrupted ones were aborted)."""
    client = llm._client
    deadline = time.monotonic() + 10
    while client.get_stats().num_running_reqs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get_stats().num_running_reqs == 0


def test_ctrl_c_in_generate_aborts_its_requests_and_the_llm_stays_usable():
    # The engine core ignores the terminal's SIGINT (its frontend decides when it stops), so
    # the interrupted requests must be aborted by the client.
    config = dict(model="null", max_model_len=65536, num_gpu_blocks_override=8192)
    with LLM(**config) as llm:
        # A real SIGINT, as a terminal sends (it interrupts the main thread's wait, which
        # _thread.interrupt_main does not).
        interrupt_long_generate(llm, threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)))
        assert_no_request_left_running(llm)
        (output,) = llm.generate("again", SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 3


def test_ctrl_c_delivered_to_another_thread_still_interrupts_generate_at_once():
    """The kernel may hand a process's SIGINT to any thread that does not block it (it does
    when the main thread has another signal pending); Python then runs the handler in the main
    thread only when that thread runs Python again, so a wait without end would sit out the
    whole generation (60,000 tokens x 2 here) before the KeyboardInterrupt."""
    config = dict(model="null", max_model_len=65536, num_gpu_blocks_override=8192)
    with LLM(**config) as llm:

        def interrupt_from_this_thread() -> None:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

        start = time.monotonic()
        interrupt_long_generate(llm, threading.Timer(0.5, interrupt_from_this_thread))
        assert time.monotonic() - start < 5.0
        assert_no_request_left_running(llm)


def test_a_missing_model_fails_fast_naming_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(model=str(missing))


def test_bad_words_are_tokenized_as_written_and_after_a_space(llm):
    """The null tokenizer is byte-level: a word and its spaced form are different sequences."""
    engine = llm._client.engine
    assert engine.bad_words_token_ids(["ab", " ab", "c"]) == [
        [97, 98],
        [32, 97, 98],
        [99],
        [32, 99],
    ]


def test_priority_other_than_0_is_refused_under_fcfs_naming_the_value_and_the_policy(llm):
    with pytest.raises(ValueError, match=r"prompt 1: priority 3 needs .* it is 'fcfs'"):
        llm.generate(["a", "b"], priority=[0, 3], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], priority=[0], use_tqdm=False)
    outputs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=0, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["**", "**"]


def test_priorities_reach_a_priority_scheduling_engine():
    with LLM(model="null", policy="priority", max_num_seqs=1, max_model_len=256) as llm:
        outputs = llm.generate(
            ["a", "b", "c"], SamplingParams(max_tokens=3), priority=[5, -2, 0], use_tqdm=False
        )
        assert [o.outputs[0].text for o in outputs] == ["***"] * 3
        with pytest.raises(
            ValueError, match=r"priority must be an integer in \[-9223372036854775808, "
        ):
            llm.generate("a", priority=2**63, use_tqdm=False)


def test_text_that_utf8_cannot_encode_in_stop_or_bad_words_is_a_value_error_naming_it(llm):
    with pytest.raises(ValueError, match=r"stop\[1\] is not valid Unicode text: surrogates"):
        llm.generate("a", SamplingParams(stop=["ok", "\ud800"]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"bad_words\[0\] is not valid Unicode text"):
        llm.generate("a", SamplingParams(bad_words=["\udfff"]), use_tqdm=False)


def test_chunked_prefill_can_be_switched_off_as_in_vllm():
    with LLM(
        model="null", enable_chunked_prefill=False, max_model_len=256, max_num_batched_tokens=256
    ) as llm:
        prompts = [list(range(1, 201)), list(range(2, 202))]  # one prompt per step
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
        assert [o.outputs[0].text for o in outputs] == ["****"] * 2
    with pytest.raises(ValueError, match="max_num_batched_tokens=128 is below max_model_len=256"):
        LLM(
            model="null",
            enable_chunked_prefill=False,
            max_model_len=256,
            max_num_batched_tokens=128,
        )
    # No budget given: the workers raise their default (the null worker's 2048) to max_model_len,
    # as vLLM does, so a prompt of 3000 tokens is prefilled in one step.
    with LLM(model="null", enable_chunked_prefill=False, max_model_len=4096) as llm:
        prompt = [i % 200 + 1 for i in range(3000)]
        output = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        assert output[0].outputs[0].text == "**"


def test_speculative_config_reaches_the_scheduler_and_never_overshoots_max_tokens(capfd):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(model="null", max_model_len=256, speculative_config=config) as llm:
        (output,) = llm.generate("**", SamplingParams(max_tokens=9, temperature=0.0))
        stats = llm._client.get_stats()
    # The engine core says so at start-up (its log goes to the inherited stderr).
    assert "speculative decoding: ngram (prompt lookup of 1-5 tokens), up to K=3" in (
        capfd.readouterr().err
    )
    assert output.outputs[0].text == NULL_TOKEN_TEXT * 9
    assert stats.spec_decode_num_drafts > 0  # the prompt and the output repeat one token
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == 3


def test_a_bad_speculative_config_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model="null", speculative_config={"method": "eagle"})
