"""Tensor parallelism on CPU (gloo): N sharded ranks give what one device gives.

- Logits: N spawned ranks each load their shard and run a prefill and a decode step over a paged
  KV cache; every rank's gathered logits match the unsharded model (KV heads split, KV heads
  replicated, vocabulary padded, tied embeddings, biases).
- Engine: greedy tokens through real worker processes with tensor_parallel_size N equal the
  single-device in-process loop (`scripts.generate`) in float32: N = 2 on a random Llama with
  8 heads / 4 KV heads, N = 3 on the default SmolLM2 (9 heads / 3 KV heads).
- KV sizing takes the minimum over ranks; kill -9 of one rank fails every in-flight request
  and leaves no process; head counts that cannot be split fail with the numbers in the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch
import torch.multiprocessing

from core_engine.common.config_error import ConfigError
from core_engine.common.ports import find_free_port
from core_engine.frontend import LLM, EngineDeadError
from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.proto import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.memory_profiler import (
    KV_CACHE_MEMORY_BYTES_ENV,
    kv_cache_memory_bytes_from_env,
)
from core_engine.worker.model_executor.model_loader import load_model
from core_engine.worker.model_executor.models import LlamaForCausalLM
from core_engine.worker.parallel_state import (
    destroy_distributed,
    init_distributed,
    share_cpu_threads,
)
from tests.e2e.test_engine_processes import child_pids, is_alive
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import (
    build_paged_batch,
    randomize_parameters,
    scattered_block_ids,
    write_byte_level_tokenizer,
)

pytestmark = pytest.mark.timeout(240)

CPU = torch.device("cpu")
BLOCK_SIZE = 16
OUTPUT_TIMEOUT_S = 60.0
# Random Llamas: head_dim 8, so `hidden_size = 8 * num_heads`; every size splits over 2, 3, 4.
TINY_LLAMA = {
    "vocab_size": 320,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_llama_folder(
    folder: Path, num_heads: int, num_kv_heads: int, seed: int = 0, **config_kwargs
) -> Path:
    """A random-weight LlamaForCausalLM (transformers' own save_pretrained) with a byte-level
    tokenizer; every parameter random, so a misplaced shard changes the logits."""
    import transformers

    config = transformers.LlamaConfig(
        **{**TINY_LLAMA, **config_kwargs},
        hidden_size=8 * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_parameters(model, seed)
    model.save_pretrained(folder)
    write_byte_level_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_8_heads(tmp_path_factory) -> Path:
    """8 query heads, 4 KV heads, untied LM head."""
    folder = tmp_path_factory.mktemp("llama-8-heads")
    return build_llama_folder(folder, 8, 4, tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """In-process references run on one thread: 2 cores are shared with the rank processes
    (and other jobs), and a second OpenMP thread that waits for a busy core costs more than
    it gives."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# ---- process-group set-up and per-rank knobs ------------------------------------------------


def test_cuda_ranks_need_one_gpu_each(monkeypatch):
    from core_engine.worker.worker import resolve_device
    from core_engine.worker.worker_factory import device_rank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    with pytest.raises(
        ValueError,
        match=r"this worker needs GPU 2 of its host .*--local-rank for a worker started on "
        r"another host\), but torch sees 2 \(CUDA_VISIBLE_DEVICES=3,4\)",
    ):
        resolve_device("cuda", 2)
    # Data-parallel core 1 of tensor parallel 2 takes GPUs 2 and 3 of its host.
    config = EngineConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1)
    assert [device_rank(config, rank) for rank in (0, 1)] == [2, 3]


def test_cpu_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert share_cpu_threads(1) == 8 == torch.get_num_threads()  # every core the process may use
    assert share_cpu_threads(3) == 2 == torch.get_num_threads()
    assert share_cpu_threads(16) == 1 == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert share_cpu_threads(2) == torch.get_num_threads() == 1  # the user's choice stands


def test_kv_cache_budget_from_the_environment_is_per_rank(monkeypatch):
    monkeypatch.delenv(KV_CACHE_MEMORY_BYTES_ENV, raising=False)
    assert kv_cache_memory_bytes_from_env(0, 2) is None
    monkeypatch.setenv(KV_CACHE_MEMORY_BYTES_ENV, "4096")
    assert [kv_cache_memory_bytes_from_env(r, 2) for r in range(2)] == [4096, 4096]
    monkeypatch.setenv(KV_CACHE_MEMORY_BYTES_ENV, "4096, 1024")
    assert [kv_cache_memory_bytes_from_env(r, 2) for r in range(2)] == [4096, 1024]
    for bad in ("1,2,3", "-5", "lots"):
        monkeypatch.setenv(KV_CACHE_MEMORY_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=rf"={bad!r} must be one byte count or 2"):
            kv_cache_memory_bytes_from_env(0, 2)


# ---- logits of spawned ranks -----------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 49)), [100, 3, 250, 17, 17, 17, 64, 9]]
DECODE_TOKEN_IDS = [11, 12, 13]
LOGITS_BLOCK_SIZE = 4


def prefill_then_decode_logits(model, num_kv_heads: int) -> list[torch.Tensor]:
    """Logits of a varlen prefill of PROMPTS, then of one decode step reading that KV cache."""
    config = model.config
    block_ids = scattered_block_ids([len(p) + 1 for p in PROMPTS], LOGITS_BLOCK_SIZE)
    num_blocks = 1 + max(max(ids) for ids in block_ids)
    shape = (2, num_blocks, LOGITS_BLOCK_SIZE, num_kv_heads, config.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
    steps = [
        ([list(p) for p in PROMPTS], [0] * len(PROMPTS)),
        (
            [[*p, t] for p, t in zip(PROMPTS, DECODE_TOKEN_IDS, strict=True)],
            [len(p) for p in PROMPTS],
        ),
    ]
    logits = []
    with torch.inference_mode():
        for token_ids, num_computed in steps:
            batch = build_paged_batch(token_ids, num_computed, block_ids, LOGITS_BLOCK_SIZE)
            hidden_states = model(batch.input_ids, batch.positions, kv_caches, batch.metadata)
            last_rows = batch.metadata.query_start_loc[1:].long() - 1
            logits.append(model.compute_logits(hidden_states[last_rows]))
    return logits


def _rank_main(rank: int, world_size: int, folder: str, port: int, out_dir: str) -> None:
    """One spawned rank: join the group, load this rank's shard, save its gathered logits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(rank, world_size, CPU)
    try:
        model, _ = load_model(Path(folder), CPU, torch.float32, tp_rank=rank, tp_size=world_size)
        num_kv_heads = model.model.layers[0].self_attn.qkv_proj.num_kv_heads
        logits = prefill_then_decode_logits(model, num_kv_heads)
        torch.save({"logits": logits, "num_kv_heads": num_kv_heads}, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_distributed()


def run_ranks(folder: Path, world_size: int, out_dir: Path) -> list[dict]:
    """Runs `_rank_main` in `world_size` spawned processes; their saved results in rank order."""
    torch.multiprocessing.start_processes(
        _rank_main,
        args=(world_size, str(folder), find_free_port(), str(out_dir)),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "kv_heads_per_rank", "config_kwargs"),
    [
        # One KV head for two ranks (MQA): both hold a copy of it. Biases: the column-parallel
        # q/k/v biases are sliced, the row-parallel o_proj bias is added once, not once per rank.
        pytest.param(4, 1, 1, {"attention_bias": True}, id="kv-head-replicated-with-biases"),
        # vocab 321 over 2 ranks is 161 rows each, one padding row; the LM head is the embedding.
        pytest.param(
            8, 4, 2, {"vocab_size": 321, "tie_word_embeddings": True}, id="vocab-padded-tied"
        ),
    ],
)
def test_two_ranks_get_the_single_device_logits(
    tmp_path, num_heads, num_kv_heads, kv_heads_per_rank, config_kwargs
):
    folder = build_llama_folder(tmp_path / "model", num_heads, num_kv_heads, **config_kwargs)
    model, _ = load_model(folder, CPU, torch.float32)
    expected = prefill_then_decode_logits(model, num_kv_heads)

    results = run_ranks(folder, 2, tmp_path)

    for rank, result in enumerate(results):
        assert result["num_kv_heads"] == kv_heads_per_rank
        for step, (logits, reference) in enumerate(zip(result["logits"], expected, strict=True)):
            assert logits.shape == reference.shape == (len(PROMPTS), model.config.vocab_size)
            torch.testing.assert_close(
                logits,
                reference,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, rank=rank, step=step: f"rank {rank} step {step}: {m}",
            )
            # Every rank samples from the same logits, bit for bit.
            assert torch.equal(logits, results[0]["logits"][step])


# ---- head counts -----------------------------------------------------------------------------


HEADS_NOT_SPLIT_IN_3 = (
    r"tensor_parallel_size=3 does not divide the model's num_attention_heads=8; "
    r"choose one of 1, 2, 4, 8"
)


def test_head_counts_that_cannot_be_split_are_rejected_with_the_numbers(llama_8_heads):
    with pytest.raises(ConfigError, match=HEADS_NOT_SPLIT_IN_3):
        load_model(llama_8_heads, CPU, torch.float32, tp_rank=0, tp_size=3)
    _, config = load_model(llama_8_heads, CPU, torch.float32)
    twelve_heads = dataclasses.replace(config, num_attention_heads=12, hidden_size=96)
    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel_size=6 exceeds the model's num_key_value_heads=4 and is not a "
        "multiple of it",
    ):
        LlamaForCausalLM(twelve_heads, tp_rank=0, tp_size=6)


@pytest.mark.slow
def test_an_engine_whose_heads_cannot_be_split_fails_to_start_and_says_why(llama_8_heads):
    """A ConfigError (a ValueError) naming the setting, as vLLM's LLM raises, not an
    EngineDeadError."""
    with pytest.raises(ConfigError, match=HEADS_NOT_SPLIT_IN_3):
        LLM(model=str(llama_8_heads), device="cpu", tensor_parallel_size=3, max_model_len=128)


# ---- engine: N = 2 on a random Llama ---------------------------------------------------------

# Per-rank CPU KV budgets in blocks; the engine must size the cache to the smaller one.
RANK_TO_NUM_BLOCKS = (64, 40)
ENGINE_LIMITS = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 256}
ENGINE_PROMPTS = [
    list(range(40, 85)),  # 45 tokens: a prefill chunked over two steps of 32
    [7, 8, 9],
    [200, 201, 3, 202, 203, 4, 5],
    list(range(100, 120)),
]


def kv_bytes_per_block(num_kv_heads_per_rank: int) -> int:
    """One block of every layer's K and V on one rank, float32."""
    head_dim, num_layers = 8, TINY_LLAMA["num_hidden_layers"]
    return 2 * BLOCK_SIZE * num_kv_heads_per_rank * head_dim * num_layers * 4


@contextlib.contextmanager
def event_loop():
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


@contextlib.asynccontextmanager
async def running_engine(config: EngineConfig, env: dict[str, str] | None = None):
    """A started core client with its core and workers (their environment plus `env`); on exit
    nothing may remain."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        client = AsyncCoreClient(config)
        await client.start()
    pids = [client.core_pid, *child_pids(client.core_pid)]
    ipc_dir = Path(client.address.removeprefix("ipc://")).parent
    try:
        yield client, pids
    finally:
        await client.shutdown()
        assert await still_alive_after(pids, timeout_s=10) == []
        assert not ipc_dir.exists()


async def still_alive_after(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running once all have exited or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return [pid for pid in pids if is_alive(pid)]


def worker_pid(core_pid: int, rank: int) -> int:
    """The pid of the core's `python -m core_engine.worker --rank RANK` child."""
    for pid in child_pids(core_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--rank" in argv and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            return pid
    raise AssertionError(f"the core (pid {core_pid}) has no worker of rank {rank}")


async def final_output(queue: asyncio.Queue) -> tuple[list[int], EngineCoreOutput]:
    """All tokens of one request and its finished output (raises what the queue carries)."""
    token_ids: list[int] = []
    while True:
        item = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
        if isinstance(item, Exception):
            raise item
        token_ids.extend(item.new_token_ids)
        if item.finished:
            return token_ids, item


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_ranks_size_the_kv_cache_to_the_smallest_rank_and_decode_like_one_device(
    llama_8_heads, async_scheduling
):
    """With async scheduling every rank appends the tokens it sampled itself (rank 0's are the
    ones reported): their histories, and so the tokens, stay the same."""
    # 4 KV heads over 2 ranks: 2 per rank.
    budgets = ",".join(str(n * kv_bytes_per_block(2)) for n in RANK_TO_NUM_BLOCKS)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    config = EngineConfig(
        model=str(llama_8_heads),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        async_scheduling=async_scheduling,
        **ENGINE_LIMITS,
    )

    async def scenario():
        async with running_engine(config, env={KV_CACHE_MEMORY_BYTES_ENV: budgets}) as (
            client,
            pids,
        ):
            assert len(pids) == 3  # the core and two workers
            assert client.ready.num_gpu_blocks == min(RANK_TO_NUM_BLOCKS)
            queues = [
                client.add_request(EngineCoreRequest(f"r{i}", prompt, params))
                for i, prompt in enumerate(ENGINE_PROMPTS)
            ]
            return [await final_output(queue) for queue in queues]

    with event_loop() as loop:
        results = loop.run_until_complete(scenario())

    single_device = msgspec.structs.replace(
        config,
        tensor_parallel_size=1,
        num_gpu_blocks_override=min(RANK_TO_NUM_BLOCKS),
        async_scheduling=False,
    )
    expected = generate_token_ids(ENGINE_PROMPTS, single_device, sampling_params=params).results
    for (token_ids, output), reference in zip(results, expected, strict=True):
        assert output.finish_reason == FinishReason.LENGTH
        assert token_ids == reference.token_ids
    # The last step's logprobs (full-vocabulary log-softmax) agree too, not only the argmax.
    for (_, output), reference in zip(results, expected, strict=True):
        (logprobs,) = output.new_logprobs
        assert logprobs.top_token_ids == reference.logprobs[-1].top_token_ids
        assert logprobs.top_logprobs == pytest.approx(reference.logprobs[-1].top_logprobs, abs=1e-4)


# ---- engine: N = 3 on the default SmolLM2 ----------------------------------------------------


# SmolLM2's tokens for "The capital of France is", "def fibonacci(n):" and "Once upon a time, in
# a small village," (token ids, so that no test process parses the GGUF's vocabulary again).
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
]


@pytest.mark.slow
def test_three_ranks_of_the_default_smollm2_decode_like_one_device():
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 9 query heads and 3 KV heads: 3 and 1 per rank.
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        tensor_parallel_size=3,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_gpu_blocks_override=64,
    )

    async def scenario():
        async with running_engine(config) as (client, pids):
            assert len(pids) == 4  # the core and three workers
            queues = [
                client.add_request(EngineCoreRequest(f"r{i}", prompt, params))
                for i, prompt in enumerate(SMOLLM2_PROMPTS)
            ]
            return [await final_output(queue) for queue in queues]

    with event_loop() as loop:
        results = loop.run_until_complete(scenario())

    single_device = msgspec.structs.replace(config, tensor_parallel_size=1)
    expected = generate_token_ids(SMOLLM2_PROMPTS, single_device, sampling_params=params).results
    assert [token_ids for token_ids, _ in results] == [r.token_ids for r in expected]


# ---- failure ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_of_one_rank_fails_every_in_flight_request_and_leaves_no_process(llama_8_heads):
    # Up to 500 tokens each: nothing finishes before the kill.
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)

    async def scenario():
        config = EngineConfig(
            model=str(llama_8_heads),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            max_model_len=512,
            num_gpu_blocks_override=200,
        )
        async with running_engine(config) as (client, pids):
            queues = [
                client.add_request(EngineCoreRequest(f"r{i}", [10 + i] * 12, params))
                for i in range(3)
            ]
            for queue in queues:
                first = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
                assert first.finish_reason is None
            rank_1_pid = worker_pid(client.core_pid, rank=1)
            os.kill(rank_1_pid, signal.SIGKILL)
            for queue in queues:
                with pytest.raises(EngineDeadError) as dead:
                    await final_output(queue)
                # The killed rank is named as the cause, before rank 0's failed collective.
                assert f"worker rank 1 (pid {rank_1_pid}) died (signal SIGKILL)" in str(dead.value)
            # The core fails, stops the surviving rank and exits, all by itself.
            assert await still_alive_after(pids, timeout_s=20) == []
            assert client.is_dead

    with event_loop() as loop:
        loop.run_until_complete(scenario())
