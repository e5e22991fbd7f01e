"""The scheduler with LoRA adapters: at most `max_loras` distinct adapters among running
requests, waiting requests of other adapters passed over in order, prefix hits never across
adapters, and the adapters reported in the stats."""

from __future__ import annotations

from core_engine.proto import LoRARequest
from tests.helpers.core_factories import make_request, make_scheduler, run_step

SQL = LoRARequest("sql", 1, "/adapters/sql")
CHAT = LoRARequest("chat", 2, "/adapters/chat")
CODE = LoRARequest("code", 3, "/adapters/code")


def running_adapters(scheduler) -> set[str | None]:
    return {r.lora_name for r in scheduler.running}


def test_a_step_never_runs_more_adapters_than_max_loras():
    scheduler = make_scheduler(max_loras=2)
    for index, adapter in enumerate([SQL, CHAT, CODE, SQL, None]):
        scheduler.add_request(
            make_request(f"r{index}", [1, 2, 3], max_tokens=3, lora_request=adapter)
        )
    output, _ = run_step(scheduler)
    started = [r.req_id for r in output.scheduled_new_reqs]
    # r2 (a third adapter) is passed over; the SQL request and the base model's behind it start.
    assert started == ["r0", "r1", "r3", "r4"]
    assert running_adapters(scheduler) == {"sql", "chat", None}
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    assert [r.lora_request for r in output.scheduled_new_reqs] == [SQL, CHAT, SQL, None]


def test_a_passed_over_request_keeps_its_place_and_starts_when_an_adapter_frees():
    scheduler = make_scheduler(max_loras=1)
    scheduler.add_request(make_request("sql", [1, 2, 3], max_tokens=2, lora_request=SQL))
    scheduler.add_request(make_request("chat-1", [4, 5, 6], max_tokens=2, lora_request=CHAT))
    scheduler.add_request(make_request("chat-2", [7, 8, 9], max_tokens=2, lora_request=CHAT))
    scheduler.add_request(make_request("sql-2", [1, 2, 3], max_tokens=2, lora_request=SQL))
    output, _ = run_step(scheduler)
    assert [r.req_id for r in output.scheduled_new_reqs] == ["sql", "sql-2"]
    assert [r.request_id for r in scheduler.waiting] == ["chat-1", "chat-2"]
    started = []
    for _ in range(10):
        output, _ = run_step(scheduler)
        started += [r.req_id for r in output.scheduled_new_reqs]
        assert len({r.lora_int_id for r in scheduler.running if r.lora_request}) <= 1
    assert started == ["chat-1", "chat-2"]
    assert not scheduler.has_unfinished_requests()


def test_without_lora_limits_adapters_are_not_counted():
    scheduler = make_scheduler()  # max_loras 0: LoRA off, nothing held back
    scheduler.add_request(make_request("a", [1, 2, 3], lora_request=SQL))
    scheduler.add_request(make_request("b", [1, 2, 3], lora_request=CHAT))
    output, _ = run_step(scheduler)
    assert len(output.scheduled_new_reqs) == 2
    assert scheduler.get_stats().running_lora_adapters == []


def test_prefix_hits_never_cross_adapters():
    scheduler = make_scheduler(max_loras=2)
    prompt = list(range(1, 18))  # four full blocks of 4
    scheduler.add_request(make_request("sql", prompt, max_tokens=1, lora_request=SQL))
    run_step(scheduler)
    for request_id, adapter in (("chat", CHAT), ("base", None), ("sql-again", SQL)):
        scheduler.add_request(make_request(request_id, prompt, max_tokens=1, lora_request=adapter))
        output, _ = run_step(scheduler)
        (new,) = output.scheduled_new_reqs
        expected = 16 if adapter is SQL else 0
        assert new.num_computed_tokens == expected, request_id


def test_a_preempted_request_resumes_under_the_adapter_limit():
    scheduler = make_scheduler(
        max_loras=1, num_gpu_blocks=8, max_model_len=24, max_num_batched_tokens=16
    )
    scheduler.add_request(make_request("sql-1", [1] * 8, max_tokens=12, lora_request=SQL))
    scheduler.add_request(make_request("sql-2", [2] * 8, max_tokens=12, lora_request=SQL))
    scheduler.add_request(make_request("chat", [3] * 4, max_tokens=2, lora_request=CHAT))
    for _ in range(60):
        run_step(scheduler)
        assert len({r.lora_int_id for r in scheduler.running}) <= 1
        if not scheduler.has_unfinished_requests():
            break
    assert scheduler.num_preemptions > 0
    assert not scheduler.has_unfinished_requests()


def test_stats_name_the_running_and_waiting_adapters():
    scheduler = make_scheduler(max_loras=1)
    scheduler.add_request(make_request("a", [1, 2, 3], lora_request=SQL))
    scheduler.add_request(make_request("b", [1, 2, 3], lora_request=CHAT))
    scheduler.add_request(make_request("c", [1, 2, 3]))
    run_step(scheduler)
    stats = scheduler.get_stats()
    assert stats.running_lora_adapters == ["sql"]
    assert stats.waiting_lora_adapters == ["chat"]
