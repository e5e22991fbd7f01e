"""Workers on other hosts: ranks that join the engine core over TCP (`--core-address`).

Other hosts are network namespaces this module creates (a bridge in the test's own namespace
holds the core's address 10.213.N.1; each other host is a namespace with a veth on the bridge,
10.213.N.2, .3, ...), so addresses, routes and interfaces differ per host as on real machines,
while one kernel runs everything. Without root / `ip` / CAP_NET_ADMIN the namespace tests skip;
the same checks also run over loopback in this namespace.

- A remote worker serves like a local one; tensor parallelism across "hosts" (gloo over the
  bridge) gives the single-device greedy tokens on the default SmolLM2.
- Bad hellos (a local rank, a wrong world size, a wrong protocol version, garbage) are rejected
  with the reason, sent back and logged, and the right worker still joins; a rank that never
  joins fails start-up naming the rank and the address.
- kill -9 of a remote worker, or of its host's link, fails in-flight requests with an error
  naming the rank and its address; kill -9 of the core ends its remote worker; no process and
  no namespace is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
import pytest

from core_engine.common.ports import find_free_port
from core_engine.common.process_watch import python_module_command
from core_engine.core.executor.multiproc_executor import MultiprocExecutor
from core_engine.frontend.core_client import AsyncCoreClient, EngineDeadError
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    MessageDecoder,
    MessageEncoder,
    SamplingParams,
    WorkerHello,
    WorkerRejected,
    WorkerWelcome,
)
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.message_pipe import (
    DEAD_PEER_TIMEOUT_S,
    KEEPALIVE_IDLE_S,
    MessagePipe,
    configure_tcp_link,
)
from core_engine.proto.worker_messages import WORKER_PROTOCOL_VERSION
from core_engine.worker.null_worker import NULL_TOKEN_ID
from tests.e2e.test_engine_processes import child_pids, is_alive
from tests.helpers.engine_helpers import generate_token_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OUTPUT_TIMEOUT_S = 60.0
NAME_PREFIX = "crw"  # core remote workers: every link and namespace this module makes


# ---- hosts -----------------------------------------------------------------------------------


@dataclass
class RemoteWorker:
    """A `python -m core_engine.worker --core-address ...` process; its log goes to a file (a pipe nobody
    reads could fill and block it)."""

    process: subprocess.Popen
    log: IO[str]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    async def exit_code(self, timeout_s: float) -> int:
        return await asyncio.to_thread(self.process.wait, timeout_s)


@dataclass
class Host:
    """Where remote workers run: a network namespace (None: the test's own) whose link to the
    core's host is `link` (its end on the bridge)."""

    address: str
    netns: str | None = None
    link: str | None = None
    workers: list[RemoteWorker] = field(default_factory=list)

    def start_worker(
        self, core_address: str, rank: int, world_size: int, *flags: str
    ) -> RemoteWorker:
        argv = [*python_module_command("core_engine.worker"), "--core-address", core_address]
        argv += ["--rank", str(rank), "--world-size", str(world_size), *flags]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]  # execs: the pid is Python's
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by Network.stop_workers)
        worker = RemoteWorker(subprocess.Popen(argv, stderr=log), log)
        self.workers.append(worker)
        return worker


@dataclass
class Network:
    core_address: str  # the core's host: where it listens for workers
    hosts: list[Host]
    bridge: str | None = None

    def worker_address(self) -> str:
        return f"tcp://{self.core_address}:{find_free_port(self.core_address)}"

    def stop_workers(self) -> list[int]:
        """Kills and reaps every worker still running; their pids."""
        running = []
        for host in self.hosts:
            for worker in host.workers:
                if worker.process.poll() is None:
                    running.append(worker.process.pid)
                    worker.process.kill()
                worker.process.wait()
                worker.log.close()
        return running


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _free_subnet() -> int:
    """N such that no address of 10.213.N.0/24 is on this host yet."""
    used = _ip("-o", "-4", "addr")
    free = [n for n in range(256) if f"10.213.{n}." not in used]
    return random.choice(free)


@contextlib.contextmanager
def namespace_hosts(num_hosts: int) -> Iterator[Network]:
    """`num_hosts` namespaces bridged to this one; removed on exit (their processes killed)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespace tests need the `ip` command (iproute2)")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(16**3):03x}"  # unique per run
    bridge = f"{NAME_PREFIX}{tag}br"
    namespaces = [f"{NAME_PREFIX}-{tag}-{i}" for i in range(num_hosts)]
    try:
        _ip("netns", "add", namespaces[0])
    except OSError as exc:
        pytest.skip(f"cannot create network namespaces (needs root / CAP_NET_ADMIN): {exc}")
    try:
        subnet = _free_subnet()
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"10.213.{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = []
        for i, netns in enumerate(namespaces):
            if i > 0:
                _ip("netns", "add", netns)
            outside, inside = f"{NAME_PREFIX}{tag}v{i}", f"{NAME_PREFIX}{tag}h{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("link", "set", inside, "netns", netns)
            _ip("-n", netns, "addr", "add", f"10.213.{subnet}.{i + 2}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            hosts.append(Host(f"10.213.{subnet}.{i + 2}", netns, outside))
        network = Network(f"10.213.{subnet}.1", hosts, bridge)
        yield network
        leftovers = network.stop_workers()
        assert leftovers == [], f"remote workers still running at the end: {leftovers}"
    finally:
        remove_namespaces(namespaces, bridge)


def remove_namespaces(namespaces: list[str], bridge: str) -> None:
    """Kills what runs in `namespaces`, deletes them and `bridge`; never raises for what is
    gone already."""
    existing = _ip("netns", "list")
    for netns in namespaces:
        if netns not in existing:
            continue
        for pid in _ip("netns", "pids", netns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            _ip("netns", "del", netns)
    with contextlib.suppress(OSError):
        _ip("link", "del", bridge)


def namespaces_left() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


@contextlib.contextmanager
def loopback_hosts(num_hosts: int) -> Iterator[Network]:
    network = Network("127.0.0.1", [Host("127.0.0.1") for _ in range(num_hosts)])
    yield network
    leftovers = network.stop_workers()
    assert leftovers == [], f"remote workers still running at the end: {leftovers}"


@pytest.fixture(params=["loopback", "netns"])
def one_other_host(request) -> Iterator[Network]:
    make = loopback_hosts if request.param == "loopback" else namespace_hosts
    with make(1) as network:
        yield network


# ---- engine helpers --------------------------------------------------------------------------


def remote_config(network: Network, **fields) -> EngineConfig:
    """One local rank (0) here, the others remote: the core listens on its host's address."""
    fields.setdefault("model", "null")
    fields.setdefault("tensor_parallel_size", 2)
    return EngineConfig(num_local_workers=1, worker_address=network.worker_address(), **fields)


@contextlib.asynccontextmanager
async def started_core(config: EngineConfig):
    """A client whose core is starting (`start` is the task to await); on exit the core and its
    local workers must be gone."""
    client = AsyncCoreClient(config)
    start = asyncio.create_task(client.start())
    await asyncio.sleep(0)
    try:
        yield client, start
    finally:
        with contextlib.suppress(BaseException):
            await start
        pids = [client.core_pid, *child_pids(client.core_pid)] if client.core_pid else []
        await client.shutdown()
        assert await still_alive_after(pids, 10) == []


async def still_alive_after(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return [pid for pid in pids if is_alive(pid)]


async def final_output(queue: asyncio.Queue) -> tuple[list[int], EngineCoreOutput]:
    token_ids: list[int] = []
    while True:
        item = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
        if isinstance(item, Exception):
            raise item
        token_ids.extend(item.new_token_ids)
        if item.finished:
            return token_ids, item


def long_requests(client: AsyncCoreClient, num_requests: int) -> list[asyncio.Queue]:
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    return [
        client.add_request(EngineCoreRequest(f"r{i}", [10 + i] * 12, params))
        for i in range(num_requests)
    ]


def hello_answer(worker_address: str, frames: list[bytes] | bytes) -> msgspec.Struct:
    """What the core answers a connection that sends `frames` (a message) or raw bytes."""
    host, port = worker_address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        pipe = MessagePipe(sock, timeout_s=10)
        if isinstance(frames, bytes):
            sock.sendall(frames)
        else:
            pipe.send(frames)
        return MessageDecoder([WorkerWelcome, WorkerRejected]).decode(pipe.recv())


# ---- configuration and plumbing --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_local_workers": 3}, r"num_local_workers must be in \[0, tensor_parallel_size=2\]"),
        ({"num_local_workers": 1}, r"rank 1 of 2 run on other hosts .* worker_address"),
        (
            {"num_local_workers": 1, "worker_address": "tcp://0.0.0.0:5000"},
            r"listens on every interface.*set dist_init_address",
        ),
        (
            {"num_local_workers": 0, "worker_address": "tcp://10.0.0.1:5000"},
            r"num_local_workers=0 puts rank 0, .* on another host",
        ),
        ({"worker_address": "tcp://10.0.0.1:5000"}, r"is set, but every rank is local"),
        (
            {"num_local_workers": 1, "worker_address": "http://10.0.0.1:5000"},
            r"worker_address must be tcp://HOST:PORT",
        ),
    ],
)
def test_worker_placement_is_validated_with_the_values(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="null", tensor_parallel_size=2, **fields)


def test_the_placement_flags_reach_the_config():
    from core_engine.frontend.openai.cli import parse_args

    config, _, _ = parse_args(
        [
            "--tensor-parallel-size", "3",
            "--num-local-workers", "1",
            "--worker-address", "tcp://0.0.0.0:29501",
            "--dist-init-address", "tcp://10.0.0.1:29500",
        ]
    )  # fmt: skip
    assert (config.num_local_ranks, list(config.remote_ranks)) == (1, [1, 2])
    assert config.worker_address == "tcp://0.0.0.0:29501"
    assert config.dist_init_address == "tcp://10.0.0.1:29500"


def test_a_tcp_link_has_no_nagle_delay_and_short_keepalives():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        configure_tcp_link(client)
        try:
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
            user_timeout_ms = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
            assert user_timeout_ms == DEAD_PEER_TIMEOUT_S * 1000 <= 15_000
        finally:
            client.close()


def test_a_worker_address_in_use_fails_before_any_worker_starts():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = EngineConfig(
            model="null",
            tensor_parallel_size=2,
            num_local_workers=1,
            worker_address=f"tcp://127.0.0.1:{port}",
        )
        children_before = child_pids(os.getpid())
        with pytest.raises(OSError, match=rf"cannot listen for workers at tcp://127.0.0.1:{port}"):
            MultiprocExecutor(config)
        assert child_pids(os.getpid()) == children_before


def test_gloo_is_pointed_at_the_interface_toward_the_rendezvous_host():
    from core_engine.worker.parallel_state import gloo_interface_toward

    assert gloo_interface_toward("127.0.0.1") == "lo"


LINK_WATCHER = """
import socket, sys, time
from core_engine.common.process_watch import exit_when_disconnected
link = socket.socket(fileno=int(sys.argv[1]))
exit_when_disconnected(link.fileno(), 5.0, "the other end")
print("watching", flush=True)
time.sleep(60)  # busy (loading a model, say): never reads the link
"""


def test_a_process_busy_elsewhere_exits_when_the_other_end_of_its_link_closes():
    """What ends a remote worker whose core died while it loads a model: it reads nothing then,
    so only its watch on the connection sees the end."""
    ours, theirs = socket.socketpair()
    watcher = subprocess.Popen(
        [sys.executable, "-c", LINK_WATCHER, str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    try:
        assert watcher.stdout.readline() == "watching\n"
        ours.close()
        assert watcher.wait(10) == -signal.SIGTERM
        assert "the other end is gone; exiting" in watcher.stderr.read()
    finally:
        watcher.kill()
        watcher.wait()
        watcher.stdout.close()
        watcher.stderr.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--core-address", "tcp://h:1", "--config", "x"], "drop --config"),
        ([], "give --core-address, or all of --pipe-fd"),
        (["--core-address", "tcp://h:1", "--world-size", "2", "--rank", "2"], "--rank must be"),
    ],
)
def test_the_worker_command_line_takes_a_core_address_or_a_pipe(argv, message):
    argv = ["--rank", "0", "--world-size", "1", *argv]
    result = subprocess.run(
        [*python_module_command("core_engine.worker"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr


# ---- joining ---------------------------------------------------------------------------------


def test_a_remote_worker_serves_like_a_local_one_and_exits_with_the_core(one_other_host):
    network = one_other_host
    config = remote_config(network, max_model_len=100_000)
    (host,) = network.hosts

    async def scenario():
        # Started before its core: it keeps dialing until the core listens.
        worker = host.start_worker(config.worker_address, 1, 2)
        async with started_core(config) as (client, start):
            await start
            params = SamplingParams(max_tokens=5)
            queue = client.add_request(EngineCoreRequest("a", [1, 2, 3], params))
            token_ids, output = await final_output(queue)
            assert token_ids == [NULL_TOKEN_ID] * 5
            assert output.finish_reason == FinishReason.LENGTH
            assert worker.process.poll() is None
        # The core's Shutdown reaches the remote worker too: a clean exit.
        assert await worker.exit_code(10) == 0
        assert f"joined the engine core at {config.worker_address}" in worker.output()

    asyncio.run(scenario())


def test_bad_hellos_are_rejected_with_the_reason_and_the_right_worker_still_joins(
    one_other_host, capfd
):
    network = one_other_host
    config = remote_config(network, tensor_parallel_size=3)  # ranks 1 and 2 are remote
    (host,) = network.hosts
    address = config.worker_address

    async def scenario():
        async with started_core(config) as (client, start):
            # While the core waits for ranks 1 and 2: a local rank and a wrong world size.
            for rank, world_size, reason in [
                (0, 3, "rank 0 is one of the engine core's local workers (rank 0); only ranks "
                 "1..2 may join over TCP"),
                (1, 4, "world size 4, but the engine's tensor_parallel_size is 3"),
            ]:  # fmt: skip
                bad = host.start_worker(address, rank, world_size, "--connect-timeout-s", "60")
                assert await bad.exit_code(60) == 1
                assert f"rejected rank {rank} of {world_size}: {reason}" in bad.output()
            for rank in (1, 2):
                host.start_worker(address, rank, 3)
            await start
            assert client.ready.vocab_size > 0

            encoder = MessageEncoder()
            for hello, reason in [
                (WorkerHello(1, 3, WORKER_PROTOCOL_VERSION + 1), "protocol version"),
                (WorkerHello(7, 3, WORKER_PROTOCOL_VERSION), "rank 7 is outside [0, 3)"),
                (WorkerHello(2, 3, WORKER_PROTOCOL_VERSION), "rank 2 has already joined"),
            ]:
                answer = hello_answer(address, encoder.encode(hello))
                assert isinstance(answer, WorkerRejected) and reason in answer.reason
            garbage = hello_answer(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert isinstance(garbage, WorkerRejected)
            assert "expected a WorkerHello" in garbage.reason

            # The engine is undisturbed.
            queue = client.add_request(EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=3)))
            assert (await final_output(queue))[0] == [NULL_TOKEN_ID] * 3

    asyncio.run(scenario())
    core_log = capfd.readouterr().err
    assert "rejected a worker claiming rank 0 from" in core_log
    assert "rejected a worker claiming rank 7 from" in core_log


def test_a_rank_that_never_joins_fails_start_up_naming_it_and_the_address(one_other_host):
    network = one_other_host
    config = remote_config(network, tensor_parallel_size=3, startup_timeout_s=3.0)
    (host,) = network.hosts

    async def scenario():
        async with started_core(config) as (client, start):
            worker = host.start_worker(config.worker_address, 1, 3)
            with pytest.raises(
                EngineDeadError,
                match=rf"worker rank 2 never joined at {config.worker_address} within "
                r"startup_timeout_s=3.0 s",
            ):
                await start
            # The rank that did join gets the core's Shutdown and exits.
            assert await worker.exit_code(10) == 0

    asyncio.run(scenario())


# ---- failures --------------------------------------------------------------------------------


def test_kill_9_of_a_remote_worker_fails_in_flight_requests(one_other_host):
    network = one_other_host
    config = remote_config(network, max_model_len=100_000, max_num_seqs=8)
    (host,) = network.hosts

    async def scenario():
        worker = host.start_worker(config.worker_address, 1, 2)
        async with started_core(config) as (client, start):
            await start
            core_pid = client.core_pid
            queues = long_requests(client, 3)
            for queue in queues:
                assert (await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)).finished is False
            worker.process.kill()
            started = time.monotonic()
            for queue in queues:
                with pytest.raises(EngineDeadError) as dead:
                    await final_output(queue)
                assert f"worker rank 1 (at {host.address}:" in str(dead.value)
                assert "closed its connection (its process exited or was killed)" in str(dead.value)
            assert time.monotonic() - started < 10
            assert await still_alive_after([core_pid], 10) == []

    asyncio.run(scenario())


def test_kill_9_of_the_core_ends_its_remote_worker(one_other_host):
    network = one_other_host
    config = remote_config(network, max_model_len=100_000)
    (host,) = network.hosts

    async def scenario():
        worker = host.start_worker(config.worker_address, 1, 2)
        async with started_core(config) as (client, start):
            await start
            queue = long_requests(client, 1)[0]
            assert (await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)).finished is False
            os.kill(client.core_pid, signal.SIGKILL)
            assert await worker.exit_code(10) != 0
            # Seen by its read of the next step, or by its watch on the connection.
            output = worker.output()
            assert "the engine core closed the pipe" in output or (
                f"the engine core at {config.worker_address} is gone" in output
            )

    asyncio.run(scenario())


def test_a_remote_host_that_vanishes_is_detected_by_keepalive():
    """The remote worker's link is cut (its veth goes down): nothing closes, no packet comes
    back; TCP's user timeout and keepalive end the link on both sides within about
    DEAD_PEER_TIMEOUT_S."""
    with namespace_hosts(1) as network:
        config = remote_config(network, max_model_len=100_000)
        (host,) = network.hosts

        async def scenario():
            worker = host.start_worker(config.worker_address, 1, 2)
            async with started_core(config) as (client, start):
                await start
                queue = long_requests(client, 1)[0]
                assert (await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)).finished is False
                _ip("link", "set", host.link, "down")
                started = time.monotonic()
                with pytest.raises(EngineDeadError) as dead:
                    await final_output(queue)
                assert time.monotonic() - started < DEAD_PEER_TIMEOUT_S + 10
                assert f"worker rank 1 (at {host.address}:" in str(dead.value)
                assert "stopped answering" in str(dead.value)
                # The worker, cut off from its core, gives up by itself too.
                assert await worker.exit_code(DEAD_PEER_TIMEOUT_S + 15) != 0

        asyncio.run(scenario())


# ---- tensor parallelism across hosts ---------------------------------------------------------

# SmolLM2's tokens for "The capital of France is" and "def fibonacci(n):".
SMOLLM2_PROMPTS = [[504, 3575, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727]]


def test_three_ranks_on_three_hosts_decode_the_default_smollm2_like_one_device():
    """SmolLM2-135M has 9 heads and 3 KV heads, so it splits over 3 ranks (not 2): rank 0 with
    the core here, ranks 1 and 2 in two other namespaces; gloo runs over the bridge."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with namespace_hosts(2) as network:
        config = remote_config(
            network,
            model=None,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=3,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=256,
            num_gpu_blocks_override=64,
        )

        async def scenario():
            workers = [
                host.start_worker(config.worker_address, rank, 3)
                for rank, host in enumerate(network.hosts, start=1)
            ]
            async with started_core(config) as (client, start):
                await start
                queues = [
                    client.add_request(EngineCoreRequest(f"r{i}", prompt, params))
                    for i, prompt in enumerate(SMOLLM2_PROMPTS)
                ]
                results = [await final_output(queue) for queue in queues]
            assert [await w.exit_code(10) for w in workers] == [0, 0]
            return [token_ids for token_ids, _ in results]

        token_ids = asyncio.run(scenario())
        namespaces = [host.netns for host in network.hosts]

    assert not set(namespaces) & set(namespaces_left())
    single_device = msgspec.structs.replace(
        config, tensor_parallel_size=1, num_local_workers=None, worker_address=None
    )
    expected = generate_token_ids(SMOLLM2_PROMPTS, single_device, sampling_params=params).results
    assert token_ids == [r.token_ids for r in expected]


@pytest.fixture(scope="module")
def llama_8_heads(tmp_path_factory) -> Path:
    from tests.e2e.test_tensor_parallel import build_llama_folder

    folder = tmp_path_factory.mktemp("llama-8-heads")
    return build_llama_folder(folder, 8, 4, tie_word_embeddings=False)


def test_kill_9_of_a_remote_rank_fails_every_in_flight_request_and_leaves_nothing(
    llama_8_heads,
):
    """A real tensor-parallel pair across two hosts: the killed remote rank is named as the
    cause, the local rank's failed collective does not hide it, and nothing is left: no core,
    no worker on either host, no namespace."""
    with namespace_hosts(1) as network:
        config = remote_config(
            network,
            model=str(llama_8_heads),
            device="cpu",
            dtype="float32",
            max_model_len=512,
            num_gpu_blocks_override=200,
        )
        (host,) = network.hosts

        async def scenario():
            worker = host.start_worker(config.worker_address, 1, 2)
            async with started_core(config) as (client, start):
                await start
                pids = [client.core_pid, *child_pids(client.core_pid)]
                queues = long_requests(client, 3)
                for queue in queues:
                    first = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
                    assert first.finish_reason is None
                worker.process.kill()
                started = time.monotonic()
                for queue in queues:
                    with pytest.raises(EngineDeadError) as dead:
                        await final_output(queue)
                    # The killed rank comes first, as the cause of rank 0's failed collective.
                    reason = str(dead.value)
                    assert f"engine core failed: worker rank 1 (at {host.address}:" in reason
                assert time.monotonic() - started < 10
                assert await still_alive_after(pids, 20) == []
                assert client.is_dead
            assert _ip("netns", "pids", host.netns).split() == []

        asyncio.run(scenario())
        namespaces = [host.netns for host in network.hosts]
    assert not set(namespaces) & set(namespaces_left())
