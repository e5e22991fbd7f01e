"""The multi-process engine with real processes and the NullWorker (model "null").

Each test starts its own core and workers and checks at the end that none of them is left and
that the private ipc directory is gone. Waits are bounded by asyncio timeouts and pytest-timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from core_engine.common.config_error import ConfigError
from core_engine.common.ports import find_free_port_pair
from core_engine.core.executor.multiproc_executor import MultiprocExecutor
from core_engine.frontend.core_client import AsyncCoreClient, EngineDeadError
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    MessageDecoder,
    MessageEncoder,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
)
from core_engine.proto.codec import TYPE_TO_CODE
from core_engine.proto.endpoints import frontend_endpoints
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.null_worker import NULL_TOKEN_ID, NULL_VOCAB_SIZE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

OUTPUT_TIMEOUT_S = 10.0
# Room for ~100k null tokens per request: long enough that nothing finishes before we act.
LONG_RUNNING = {"max_num_seqs": 8, "max_model_len": 100_000}


# ---- process helpers -------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first, then ppid), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def is_alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie waiting to be reaped."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        fields = _proc_stat(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z" and int(fields[1]) == pid:
            children.append(int(entry))
    return children


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


async def next_item(queue: asyncio.Queue) -> EngineCoreOutput | Exception:
    return await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)


async def last_item(queue: asyncio.Queue) -> EngineCoreOutput | Exception:
    """Skips unfinished outputs; returns the finished output or the exception that ends them."""
    while isinstance(item := await next_item(queue), EngineCoreOutput) and not item.finished:
        pass
    return item


async def collect(queue: asyncio.Queue) -> list[EngineCoreOutput]:
    """Every output of one request up to its finished one; raises what the queue raises."""
    outputs = []
    while True:
        item = await next_item(queue)
        if isinstance(item, Exception):
            raise item
        outputs.append(item)
        if item.finished:
            return outputs


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def request(request_id: str, num_prompt_tokens: int = 20, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(range(num_prompt_tokens)), SamplingParams(**params))


@contextlib.asynccontextmanager
async def running_engine(**config_fields):
    """A started client with its core and workers; on exit: shut down, nothing may remain."""
    client = AsyncCoreClient(EngineConfig(model="null", **config_fields))
    await client.start()
    pids = [client.core_pid, *child_pids(client.core_pid)]
    ipc_dir = Path(client.address.removeprefix("ipc://")).parent
    try:
        yield client, pids
    finally:
        await client.shutdown()
        assert [pid for pid in pids if is_alive(pid)] == []
        assert not ipc_dir.exists()


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---- serving ---------------------------------------------------------------------------------


def test_requests_round_trip_with_logprobs_and_stop_tokens():
    async def scenario():
        async with running_engine() as (client, pids):
            assert client.ready == EngineReady(
                num_gpu_blocks=256 * 256 + 1,
                block_size=16,
                max_model_len=4096,
                max_num_batched_tokens=2048,  # the NullWorker's default step budget
                vocab_size=NULL_VOCAB_SIZE,
            )
            assert len(pids) == 2  # the core and one worker
            plain = client.add_request(request("plain", max_tokens=5))
            with_logprobs = client.add_request(request("logprobs", max_tokens=2, logprobs=3))
            stopped = client.add_request(
                request("stop", max_tokens=9, stop_token_ids=[NULL_TOKEN_ID])
            )
            outputs = await collect(plain)
            assert tokens_of(outputs) == [NULL_TOKEN_ID] * 5
            assert outputs[-1].finish_reason == FinishReason.LENGTH
            outputs = await collect(with_logprobs)
            assert [len(o.new_logprobs[0].top_token_ids) for o in outputs] == [3, 3]
            outputs = await collect(stopped)
            assert tokens_of(outputs) == [NULL_TOKEN_ID]
            assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (
                FinishReason.STOP,
                NULL_TOKEN_ID,
            )
            with pytest.raises(ValueError, match="already in flight"):
                client.add_request(request("dup", max_tokens=None))
                client.add_request(request("dup"))
            assert isinstance(await client.get_stats(), SchedulerStats)

    asyncio.run(scenario())


def test_64_concurrent_requests_complete_and_kv_usage_returns_to_zero():
    async def scenario():
        async with running_engine(max_num_seqs=16, max_num_batched_tokens=256) as (client, _):
            assert client.ready.max_num_batched_tokens == 256  # the configured budget wins
            queues = [
                client.add_request(request(f"r{i}", 10 + i, max_tokens=8 + i % 5))
                for i in range(64)
            ]
            results = await asyncio.gather(*(collect(queue) for queue in queues))
            for i, outputs in enumerate(results):
                assert tokens_of(outputs) == [NULL_TOKEN_ID] * (8 + i % 5)
            stats = await client.get_stats()
            assert (stats.kv_cache_usage, stats.num_running_reqs, stats.num_waiting_reqs) == (
                0,
                0,
                0,
            )
            assert stats.num_generation_tokens == sum(8 + i % 5 for i in range(64))
            assert await client.reset_prefix_cache() is True

    asyncio.run(scenario())


def test_abort_frees_blocks_and_finishes_the_queue():
    async def scenario():
        async with running_engine(**LONG_RUNNING) as (client, _):
            queue = client.add_request(request("long", 100, max_tokens=None))
            assert (await next_item(queue)).finish_reason is None
            assert (await client.get_stats()).kv_cache_usage > 0
            assert await client.reset_prefix_cache() is False  # blocks are in use
            await client.abort(["long", "never-existed"])
            assert (await last_item(queue)).finish_reason == FinishReason.ABORT
            assert queue.empty()
            stats = await client.get_stats()
            assert (stats.kv_cache_usage, stats.num_running_reqs) == (0, 0)
            follow_up = await collect(client.add_request(request("after", max_tokens=2)))
            assert tokens_of(follow_up) == [NULL_TOKEN_ID] * 2

    asyncio.run(scenario())


def test_too_long_and_invalid_prompts_come_back_as_errors_and_the_engine_keeps_serving():
    async def scenario():
        async with running_engine() as (client, _):
            outputs = await collect(client.add_request(request("too-long", 4097)))
            assert outputs[-1].finish_reason == FinishReason.ERROR
            assert "the prompt is 4097 tokens long" in outputs[-1].error
            assert "maximum context length is 4096 tokens" in outputs[-1].error
            negative = EngineCoreRequest("negative", [1, -5], SamplingParams())
            outputs = await collect(client.add_request(negative))
            assert outputs[-1].finish_reason == FinishReason.ERROR and "-5" in outputs[-1].error
            beyond = EngineCoreRequest("beyond", [1, NULL_VOCAB_SIZE], SamplingParams())
            outputs = await collect(client.add_request(beyond))
            assert outputs[-1].finish_reason == FinishReason.ERROR
            assert f"outside the vocabulary [0, {NULL_VOCAB_SIZE})" in outputs[-1].error
            empty = await collect(client.add_request(request("empty", 0)))
            assert empty[-1].finish_reason == FinishReason.ERROR and "empty" in empty[-1].error
            fine = await collect(client.add_request(request("fine", max_tokens=3)))
            assert tokens_of(fine) == [NULL_TOKEN_ID] * 3

    asyncio.run(scenario())


def test_executor_step_answer_arrives_on_a_pipe_its_owner_polls():
    """The executor only sends and receives: after `send_step` the owner polls the workers'
    pipes next to its own sockets, and the readable pipe yields rank 0's answer."""
    executor = MultiprocExecutor(EngineConfig(model="null", tensor_parallel_size=2))
    pids = [worker.process.pid for worker in executor.workers]
    try:
        executor.wait_until_ready()
        executor.initialize_cache(16)
        poller = zmq.Poller()
        for fd in executor.pipe_fds():
            poller.register(fd, zmq.POLLIN)
        assert poller.poll(100) == []  # workers speak only when asked
        executor.send_step(SchedulerOutput([], [], {}, total_num_scheduled_tokens=0))
        ready = poller.poll(10_000)
        assert len(ready) == 1  # only rank 0 answers a step
        output = executor.receive_step_output(ready[0][0])
        assert output.req_ids == []
        assert poller.poll(100) == []
    finally:
        executor.shutdown()
    assert not any(is_alive(pid) for pid in pids)


def test_tensor_parallel_workers_all_start_and_rank_0_answers():
    async def scenario():
        async with running_engine(tensor_parallel_size=2) as (client, pids):
            assert len(pids) == 3  # the core and two workers
            outputs = await collect(client.add_request(request("tp", max_tokens=4)))
            assert tokens_of(outputs) == [NULL_TOKEN_ID] * 4

    asyncio.run(scenario())


# ---- malformed input -------------------------------------------------------------------------


class RawFrontend:
    """Binds the frontend sockets itself and runs `python -m core_engine.core` as a hand-started core."""

    def __init__(self, ipc_dir: Path, *core_flags: str) -> None:
        self.context = zmq.Context()
        address = f"ipc://{ipc_dir}/engine"
        endpoints = frontend_endpoints(address)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(endpoints.requests)
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(endpoints.outputs)
        argv = [
            sys.executable,
            "-m",
            "core_engine.core",
            "--frontend-address",
            address,
            "--model",
            "null",
        ]
        self.process = subprocess.Popen([*argv, "--watch-parent", *core_flags])
        self.encoder = MessageEncoder()
        self.output_decoder = MessageDecoder([EngineCoreOutputs])
        assert self.router.poll(30_000), "the core never sent EngineReady"
        self.routing_id, *frames = self.router.recv_multipart()
        self.ready = MessageDecoder([EngineReady]).decode(frames)

    def send_frames(self, frames: list[bytes]) -> None:
        self.router.send_multipart([self.routing_id, *frames])

    def send(self, message: msgspec.Struct) -> None:
        self.send_frames(self.encoder.encode(message))

    def wait_finished(self, request_id: str) -> EngineCoreOutput:
        deadline = time.monotonic() + OUTPUT_TIMEOUT_S
        while self.pull.poll(max(deadline - time.monotonic(), 0) * 1000):
            for output in self.output_decoder.decode(self.pull.recv_multipart()).outputs:
                if output.request_id == request_id and output.finished:
                    return output
        raise AssertionError(f"no finished output for {request_id!r}")

    def close(self) -> None:
        self.process.terminate()
        assert self.process.wait(OUTPUT_TIMEOUT_S) == 0
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.context.term()


def test_garbage_and_wrongly_typed_frames_are_rejected_and_the_engine_keeps_serving(tmp_path):
    frontend = RawFrontend(tmp_path, "--max-frame-bytes", "65536")
    worker_pids = child_pids(frontend.process.pid)
    try:
        request_code = TYPE_TO_CODE[EngineCoreRequest]
        frontend.send_frames([b"one frame only"])
        frontend.send_frames([b"\xff", b"unknown type code"])
        frontend.send_frames([request_code, b"\xc1 not msgpack"])
        frontend.send(EngineReady(1, 2, 3, 4, 5))  # a real message, but not one the core accepts
        frontend.send_frames([request_code, msgspec.msgpack.encode(["typed", "not a list", {}])])
        bad_params = msgspec.msgpack.encode(["bad-params", [1, 2], {"temperature": -1.0}])
        frontend.send_frames([request_code, bad_params])
        frontend.send_frames([request_code, b"x" * 100_000])  # over max_frame_bytes

        for request_id, text in [("typed", "Expected `array`"), ("bad-params", "temperature")]:
            output = frontend.wait_finished(request_id)
            assert output.finish_reason == FinishReason.ERROR
            assert "malformed request" in output.error and text in output.error
        frontend.send(request("ok", max_tokens=2))
        assert frontend.wait_finished("ok").finish_reason == FinishReason.LENGTH
        assert frontend.process.poll() is None
    finally:
        frontend.close()
    assert [pid for pid in worker_pids if is_alive(pid)] == []
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "engine-outputs",
        "engine-requests",
    ]  # the frontend's two sockets, nothing of the core's


# ---- failures and shutdown -------------------------------------------------------------------


def test_kill_9_of_a_worker_fails_every_in_flight_request_and_the_core_exits():
    async def scenario():
        async with running_engine(**LONG_RUNNING) as (client, pids):
            core_pid, worker_pid = pids
            queues = [client.add_request(request(f"r{i}", 30, max_tokens=None)) for i in range(5)]
            for queue in queues:
                assert (await next_item(queue)).finish_reason is None
            os.kill(worker_pid, signal.SIGKILL)
            started = time.monotonic()
            for queue in queues:
                item = await last_item(queue)
                assert isinstance(item, EngineDeadError)
                assert f"worker rank 0 (pid {worker_pid}) died (signal SIGKILL)" in str(item)
            assert time.monotonic() - started < 10
            await wait_until(lambda: client.is_dead, 10, "the client sees the engine die")
            assert "worker rank 0" in client.dead_reason
            await wait_until(lambda: not is_alive(core_pid), 10, "the core exits")
            with pytest.raises(EngineDeadError, match="worker rank 0"):
                client.add_request(request("late"))

    asyncio.run(scenario())


def test_kill_9_of_a_worker_of_an_idle_engine_is_seen_without_a_request():
    """Between steps the core waits on the frontend and the workers' pipes together."""

    async def scenario():
        async with running_engine() as (client, pids):
            core_pid, worker_pid = pids
            os.kill(worker_pid, signal.SIGKILL)
            await wait_until(lambda: client.is_dead, 10, "the client sees the engine die")
            assert f"worker rank 0 (pid {worker_pid}) died (signal SIGKILL)" in client.dead_reason
            await wait_until(lambda: not is_alive(core_pid), 10, "the core exits")

    asyncio.run(scenario())


def test_kill_9_of_the_core_raises_engine_dead_error_and_the_worker_exits():
    async def scenario():
        async with running_engine(**LONG_RUNNING) as (client, pids):
            core_pid, worker_pid = pids
            queue = client.add_request(request("long", max_tokens=None))
            assert (await next_item(queue)).finish_reason is None
            os.kill(core_pid, signal.SIGKILL)
            item = await last_item(queue)
            assert isinstance(item, EngineDeadError) and "signal SIGKILL" in str(item)
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                client.add_request(request("late"))
            with pytest.raises(EngineDeadError):
                await client.get_stats()
            await wait_until(lambda: not is_alive(worker_pid), 10, "the orphaned worker exits")

    asyncio.run(scenario())


def test_sigterm_of_the_core_exits_cleanly_without_leftovers():
    async def scenario():
        async with running_engine(**LONG_RUNNING) as (client, pids):
            core_pid, worker_pid = pids
            ipc_dir = Path(client.address.removeprefix("ipc://")).parent
            frontend_sockets = sorted(ipc_dir.iterdir())
            queue = client.add_request(request("long", max_tokens=None))
            assert (await next_item(queue)).finish_reason is None
            os.kill(core_pid, signal.SIGTERM)
            item = await last_item(queue)
            assert isinstance(item, EngineDeadError) and "stopped by SIGTERM" in str(item)
            await wait_until(
                lambda: client.core_process.process.poll() is not None, 10, "the core exits"
            )
            assert client.core_process.process.returncode == 0
            assert not is_alive(worker_pid)
            assert sorted(ipc_dir.iterdir()) == frontend_sockets  # the core left nothing

    asyncio.run(scenario())


def test_a_core_that_cannot_start_fails_start_and_leaves_nothing():
    async def scenario():
        client = AsyncCoreClient(EngineConfig(model="null", num_gpu_blocks_override=2))
        with pytest.raises(ConfigError, match="cannot hold one request of max_model_len=4096"):
            await client.start()
        assert client.core_process.process.poll() is not None
        assert not Path(client.address.removeprefix("ipc://")).parent.exists()

    asyncio.run(scenario())


def test_a_separately_started_core_connects_over_tcp_and_its_death_is_noticed(tmp_path):
    async def scenario():
        address = f"tcp://127.0.0.1:{find_free_port_pair()}"
        argv = [
            sys.executable,
            "-m",
            "core_engine.core",
            "--frontend-address",
            address,
            "--model",
            "null",
        ]
        argv += ["--max-num-seqs", "4", "--max-model-len", "100000"]
        # Anything the core writes to TMPDIR would stay there after its kill -9.
        core = subprocess.Popen(argv, env={**os.environ, "TMPDIR": str(tmp_path)})
        worker_pids: list[int] = []
        client = AsyncCoreClient(EngineConfig(model="null"), address, launch_core=False)
        try:
            await client.start()
            assert client.core_pid is None and client.ready.max_model_len == 100_000
            worker_pids = child_pids(core.pid)
            outputs = await collect(client.add_request(request("tcp", max_tokens=3)))
            assert tokens_of(outputs) == [NULL_TOKEN_ID] * 3
            queue = client.add_request(request("long", max_tokens=None))
            assert (await next_item(queue)).finish_reason is None
            core.kill()
            item = await last_item(queue)
            assert isinstance(item, EngineDeadError) and "disconnected" in str(item)
            await wait_until(
                lambda: not any(map(is_alive, worker_pids)), 10, "the orphaned worker exits"
            )
            assert list(tmp_path.iterdir()) == []
        finally:
            await client.shutdown()
            kill_all([core.pid, *worker_pids])
            core.wait()

    asyncio.run(scenario())


FRONTEND_SCRIPT = """
import asyncio
from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.proto.engine_config import EngineConfig

async def main():
    client = AsyncCoreClient(EngineConfig(model="null"))
    await client.start()
    print(client.core_pid, client.address, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_kill_9_of_the_frontend_makes_the_core_and_its_worker_exit():
    frontend = subprocess.Popen([sys.executable, "-c", FRONTEND_SCRIPT], stdout=subprocess.PIPE)
    core_pid, address = frontend.stdout.readline().decode().split()
    core_pid = int(core_pid)
    pids = [core_pid, *child_pids(core_pid)]
    ipc_dir = Path(address.removeprefix("ipc://")).parent
    try:
        assert len(pids) == 2
        assert len(list(ipc_dir.iterdir())) == 2  # the frontend's two sockets
        frontend.kill()
        frontend.wait()
        asyncio.run(wait_until(lambda: not any(map(is_alive, pids)), 15, "core and worker exit"))
        assert not ipc_dir.exists()  # the core removed what its dead frontend left
    finally:
        kill_all(pids)
        frontend.stdout.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)  # left only if the test failed


def test_a_users_own_core_and_worker_folders_do_not_shadow_the_engine(tmp_path):
    """The engine's subprocesses start with a safe import path: run from a folder holding
    packages named core/ and worker/, the engine still runs its own."""
    for name in ("core", "worker"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"open({str(tmp_path / (name + '.imported'))!r}, 'w').close()\n"
            f"raise SystemExit('a user package named {name} was imported')\n"
        )
    script = (
        "from core_engine.frontend.llm import LLM\n"
        "from core_engine.proto import SamplingParams\n"
        "with LLM(model='null', max_model_len=64) as llm:\n"
        "    (out,) = llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "    print(len(out.outputs[0].token_ids))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "2"
    assert not list(tmp_path.glob("*.imported"))
