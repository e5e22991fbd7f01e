"""LoRA adapters in the frontend, without an engine process: the adapter registry, the checkpoint
check and its cache, `AsyncEngineClient` / `EngineClient` / `LLM` putting an adapter on the core
request, data-parallel routing by the adapter-keyed block hashes, the merged stats, the
`lora_requests_info` gauge and core-serve's LoRA flags.

The engine core is `FakeCoreClient` (ready at once, every request answered at once); adapters are
PEFT folders written with safetensors into tmp_path. test_lora_server.py imports these helpers.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

from core_engine.common.block_hash import compact_block_hash, prompt_block_hashes
from core_engine.frontend import LLM, EngineClient, LoRARequest, SamplingParams
from core_engine.frontend import async_engine_client as async_engine_client_module
from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.data_parallel_client import DataParallelCoreClient, sum_stats
from core_engine.frontend.lora_adapter_registry import (
    LoRAAdapterNotFoundError,
    LoRAAdapterRegistry,
)
from core_engine.frontend.metrics import EngineMetrics
from core_engine.frontend.openai.cli import RUNTIME_LORA_UPDATING_ENV, parse_args
from core_engine.frontend.openai.lora_modules import LoRAModulePath
from core_engine.frontend.prefix_router import PrefixAwareRouter
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    LoRATargetShapes,
    SchedulerStats,
)
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.lora_checkpoint_cache import LoRACheckpointCache
from core_engine.proto.parameter_error import ParameterError

# A served model of 2 layers whose adapters, of rank 16 at most, may target q_proj (64 -> 64)
# and v_proj (64 -> 32).
SHAPES = LoRATargetShapes(
    num_layers=2, modules={"q_proj": (64, 64), "v_proj": (64, 32)}, max_rank=16
)
NULL_VOCAB_SIZE = 256  # the null model's byte tokenizer
LORA_CONFIG = EngineConfig(model="null", enable_lora=True, max_loras=2)


def write_adapter(folder: Path, rank: int = 4, config_text: str | None = None) -> str:
    """A PEFT adapter folder for SHAPES (`config_text` replaces adapter_config.json); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": list(SHAPES.modules),
    }
    (folder / "adapter_config.json").write_text(config_text or json.dumps(config))
    tensors = {}
    for layer in range(SHAPES.num_layers):
        for module, (in_features, out_features) in SHAPES.modules.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.zeros((rank, in_features), np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_features, rank), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


class FakeCoreClient:
    """A `CoreClient` without a process: ready at once (with SHAPES, of the config's
    max_lora_rank, when the config enables LoRA), every request answered at once with `max_tokens` tokens 42 ("*") and LENGTH. Keeps
    every request sent in `requests`; `stats` is what the stats calls answer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.requests: list[EngineCoreRequest] = []
        self.stats = SchedulerStats()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def start(self) -> None:
        self.ready = EngineReady(
            num_gpu_blocks=64,
            block_size=16,
            max_model_len=1024,
            max_num_batched_tokens=1024,
            vocab_size=NULL_VOCAB_SIZE,
            lora_target_shapes=(
                replace(SHAPES, max_rank=self.config.max_lora_rank)
                if self.config.enable_lora
                else None
            ),
        )

    def add_request(self, request: EngineCoreRequest) -> asyncio.Queue:
        self.requests.append(request)
        num_tokens = request.sampling_params.max_tokens or 1
        output_queue: asyncio.Queue = asyncio.Queue()
        output = EngineCoreOutput(request.request_id, [42] * num_tokens, FinishReason.LENGTH)
        output_queue.put_nowait(output)
        return output_queue

    async def abort(self, request_ids: list[str], error: Exception | None = None) -> None:
        pass

    async def wait_until_dead(self) -> str:
        await asyncio.Event().wait()
        return "never"

    async def get_stats(self) -> SchedulerStats:
        return self.stats

    async def get_stats_per_core(self) -> list[SchedulerStats]:
        return [self.stats]

    async def get_kv_block_maps(self) -> list:
        return []

    async def reset_prefix_cache(self) -> bool:
        return True

    async def shutdown(self) -> None:
        self.dead_reason = self.dead_reason or "the engine client was shut down"


def use_fake_cores(monkeypatch: pytest.MonkeyPatch) -> list[FakeCoreClient]:
    """Every engine client made from now on runs on a new FakeCoreClient, listed here."""
    cores: list[FakeCoreClient] = []

    def make(config: EngineConfig, address: str | None = None, **_: object) -> FakeCoreClient:
        cores.append(FakeCoreClient(config))
        return cores[-1]

    monkeypatch.setattr(async_engine_client_module, "AsyncCoreClient", make)
    return cores


@pytest.fixture()
def fake_cores(monkeypatch) -> list[FakeCoreClient]:
    return use_fake_cores(monkeypatch)


async def started_engine(config: EngineConfig = LORA_CONFIG) -> AsyncEngineClient:
    engine = AsyncEngineClient(config)
    await engine.start()
    return engine


async def final_output(stream):
    outputs = [output async for output in stream]
    return outputs[-1]


# ---- the checkpoint check and its cache --------------------------------------------------------


def test_a_good_adapter_is_read_once_per_id_and_path(tmp_path, monkeypatch):
    import core_engine.proto.lora_checkpoint_cache as cache_module

    calls = []
    real_check = cache_module.check_lora_checkpoint
    monkeypatch.setattr(
        cache_module,
        "check_lora_checkpoint",
        lambda *args: calls.append(args[0]) or real_check(*args),
    )
    path = write_adapter(tmp_path / "sql")
    cache = LoRACheckpointCache(SHAPES)
    assert cache.check(LoRARequest("sql", 1, path)).rank == 4
    cache.check(LoRARequest("sql", 1, path))
    assert calls == [path] and len(cache) == 1
    cache.check(LoRARequest("sql-again", 2, path))  # a new id is new weights: read again
    assert calls == [path, path]


def test_a_bad_adapter_is_refused_naming_the_problem_and_read_again_next_time(tmp_path):
    cache = LoRACheckpointCache(SHAPES)
    path = write_adapter(tmp_path / "big", rank=32)
    with pytest.raises(ParameterError) as error:
        cache.check(LoRARequest("big", 1, path))
    assert error.value.param == "lora_request"
    assert "'big'" in str(error.value) and "rank (r) 32, above max_lora_rank 16" in str(error.value)
    write_adapter(tmp_path / "big", rank=8)  # fixed on disk: the same id and path now pass
    assert cache.check(LoRARequest("big", 1, path)).rank == 8

    broken = write_adapter(tmp_path / "broken", config_text="{not json")
    with pytest.raises(ParameterError, match="adapter_config.json' is not valid JSON"):
        cache.check(LoRARequest("broken", 2, broken))
    with pytest.raises(ParameterError, match="does not exist"):
        cache.check(LoRARequest("missing", 3, str(tmp_path / "missing")))


def test_an_id_already_checked_for_another_path_is_refused(tmp_path):
    cache = LoRACheckpointCache(SHAPES)
    cache.check(LoRARequest("a", 1, write_adapter(tmp_path / "a")))
    with pytest.raises(ParameterError, match="lora_int_id 1 already names the adapter at"):
        cache.check(LoRARequest("b", 1, write_adapter(tmp_path / "b")))


# ---- the registry ------------------------------------------------------------------------------


def make_registry() -> LoRAAdapterRegistry:
    return LoRAAdapterRegistry(LoRACheckpointCache(SHAPES).check, ("base", "alias"))


def test_registry_loads_resolves_and_unloads_with_ids_never_reused(tmp_path):
    registry = make_registry()
    sql = registry.load("sql", write_adapter(tmp_path / "sql"))
    chat = registry.load("chat", write_adapter(tmp_path / "chat"), base_model_name="alias")
    assert sql.lora_request == LoRARequest("sql", 1, str(tmp_path / "sql"))
    assert (chat.lora_request.lora_int_id, chat.base_model_name) == (2, "alias")
    assert registry.resolve("sql") == sql.lora_request
    assert registry.resolve("base") is None and registry.resolve(None) is None
    assert [adapter.name for adapter in registry.adapters] == ["sql", "chat"]

    assert registry.unload("sql") == sql
    assert registry.resolve("sql") is None and "sql" not in registry
    reloaded = registry.load("sql", str(tmp_path / "sql"))
    assert reloaded.lora_request.lora_int_id == 3  # fresh weights in the workers


def test_registry_refuses_names_and_paths_naming_the_field(tmp_path):
    registry = make_registry()
    path = write_adapter(tmp_path / "sql")
    registry.load("sql", path)
    refusals = [
        (("sql", path), "lora_name", "'sql' is already loaded"),
        (("base", path), "lora_name", "is a served name of the base model"),
        (("", path), "lora_name", "lora_name is empty"),
        (("x", ""), "lora_path", "lora_path is empty"),
        (("x", path, "other"), "base_model_name", "'other' is not served here"),
        (("x", str(tmp_path / "nowhere")), "lora_path", "does not exist"),
        (("x", write_adapter(tmp_path / "big", rank=64)), "lora_path", "above max_lora_rank"),
    ]
    for args, param, message in refusals:
        with pytest.raises(ParameterError, match=message) as error:
            registry.load(*args)
        assert error.value.param == param, args
    assert [adapter.name for adapter in registry.adapters] == ["sql"]

    with pytest.raises(LoRAAdapterNotFoundError, match="no LoRA adapter named 'nope'") as error:
        registry.unload("nope")
    assert error.value.param == "lora_name" and "`sql`" in str(error.value)


# ---- the engine clients ------------------------------------------------------------------------


def test_the_adapter_rides_on_every_core_request_and_comes_back_on_the_output(tmp_path, fake_cores):
    lora = LoRARequest("sql", 7, write_adapter(tmp_path / "sql"))

    async def run():
        engine = await started_engine()
        params = SamplingParams(max_tokens=3, n=2)
        final = await final_output(engine.generate("hi", params, stream=False, lora_request=lora))
        base = await final_output(engine.generate("hi", SamplingParams(max_tokens=1)))
        await engine.shutdown()
        return final, base

    final, base = asyncio.run(run())
    (core,) = fake_cores
    assert [request.lora_request for request in core.requests] == [lora, lora, None]
    assert final.lora_request == lora and [c.text for c in final.outputs] == ["***", "***"]
    assert base.lora_request is None


def test_an_adapter_is_refused_at_submission_when_bad_or_when_lora_is_off(tmp_path, fake_cores):
    big = LoRARequest("big", 1, write_adapter(tmp_path / "big", rank=32))
    good = LoRARequest("good", 2, write_adapter(tmp_path / "good"))

    async def run():
        engine = await started_engine()
        with pytest.raises(ParameterError, match="above max_lora_rank 16") as error:
            engine.generate("hi", lora_request=big)
        assert error.value.param == "lora_request"
        plain = await started_engine(EngineConfig(model="null"))
        with pytest.raises(ValueError, match="start it with --enable-lora"):
            plain.generate("hi", lora_request=good)
        assert not plain.supports_lora and engine.supports_lora
        await engine.shutdown()
        await plain.shutdown()

    asyncio.run(run())
    assert [core.requests for core in fake_cores] == [[], []]  # nothing reached an engine


def test_engine_client_and_llm_pass_adapters_one_for_all_or_one_per_prompt(tmp_path, fake_cores):
    sql = LoRARequest("sql", 1, write_adapter(tmp_path / "sql"))
    chat = LoRARequest("chat", 2, write_adapter(tmp_path / "chat"))
    params = SamplingParams(max_tokens=2)
    with EngineClient(LORA_CONFIG) as client:
        outputs = list(client.generate("hi", params, stream=False, lora_request=sql))
        assert outputs[-1].lora_request == sql
    with LLM("null", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        assert fake_cores[-1].config.max_lora_rank == 8
        llm.generate(["a", "b"], params, use_tqdm=False, lora_request=sql)
        llm.generate(["a", "b", "c"], params, use_tqdm=False, lora_request=[sql, None, chat])
        llm.chat([{"role": "user", "content": "x"}], params, use_tqdm=False, lora_request=chat)
        with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
            llm.generate(["a", "b"], params, use_tqdm=False, lora_request=[sql])
        big = LoRARequest("big", 3, write_adapter(tmp_path / "big", rank=9))
        with pytest.raises(ValueError, match="prompt 0: LoRA adapter 'big'.*above max_lora_rank 8"):
            llm.generate(["a"], params, use_tqdm=False, lora_request=big)
    sent = [request.lora_request for request in fake_cores[-1].requests]
    assert sent == [sql, sql, sql, None, chat, chat]


# ---- data parallelism --------------------------------------------------------------------------


def test_the_router_hashes_prompts_keyed_by_the_adapter_name():
    seed = bytes(16)
    router = PrefixAwareRouter(2, block_size=4, seed=seed, capacity=100)
    tokens = list(range(8))
    expected = [compact_block_hash(h) for h in prompt_block_hashes(tokens, 4, seed, None, "sql")]
    assert router.block_hashes(tokens, None, "sql") == expected
    assert router.block_hashes(tokens) != expected != router.block_hashes(tokens, None, "chat")


def test_a_data_parallel_request_is_routed_by_its_adapter_keyed_hashes():
    dp_client = DataParallelCoreClient(EngineConfig(model="null", data_parallel_size=2))
    dp_client.cores = [FakeCoreClient(dp_client.config) for _ in range(2)]
    dp_client.router = PrefixAwareRouter(2, 4, dp_client.seed, capacity=100)
    dp_client.ready = object()  # started
    tokens = list(range(8))
    lora = LoRARequest("sql", 1, "/adapters/sql")
    request = EngineCoreRequest("r1", tokens, SamplingParams(max_tokens=1), lora_request=lora)
    dp_client.add_request(request)
    (core,) = [rank for rank, fake in enumerate(dp_client.cores) if fake.requests]
    mirror = dp_client.router.mirrors[core]
    assert all(h in mirror for h in dp_client.router.block_hashes(tokens, None, "sql"))
    assert not any(h in mirror for h in dp_client.router.block_hashes(tokens))


def test_summed_stats_list_each_adapter_once_in_core_order():
    per_core = [
        SchedulerStats(num_running_reqs=1, running_lora_adapters=["a", "b"]),
        SchedulerStats(num_running_reqs=2, running_lora_adapters=["b", "c"]),
    ]
    per_core[1].waiting_lora_adapters.append("d")
    total = sum_stats(per_core)
    assert total.num_running_reqs == 3
    assert (total.running_lora_adapters, total.waiting_lora_adapters) == (["a", "b", "c"], ["d"])
    assert sum_stats([SchedulerStats()]).running_lora_adapters == []


# ---- metrics -----------------------------------------------------------------------------------


def lora_samples(text: str) -> list:
    return [
        sample
        for family in text_string_to_metric_families(text)
        if family.name == "core:lora_requests_info"
        for sample in family.samples
    ]


def test_the_lora_requests_info_gauge_names_the_adapters_at_the_snapshot_time():
    stats = SchedulerStats(running_lora_adapters=["sql", "chat"], waiting_lora_adapters=["x"])
    before = time.time()
    text = EngineMetrics("m", max_loras=4).render_prometheus(stats).decode()
    (sample,) = lora_samples(text)
    assert sample.labels == {
        "max_lora": "4",
        "running_lora_adapters": "sql,chat",
        "waiting_lora_adapters": "x",
    }
    assert before <= sample.value <= time.time()
    assert "# TYPE core:lora_requests_info gauge" in text
    assert lora_samples(EngineMetrics("m").render_prometheus(stats).decode()) == []


def test_an_engine_client_exports_the_gauge_only_with_enable_lora():
    with_lora = AsyncEngineClient(LORA_CONFIG).metrics.render_prometheus(SchedulerStats())
    assert lora_samples(with_lora.decode())[0].labels["max_lora"] == "2"
    without = AsyncEngineClient(EngineConfig(model="null")).metrics
    assert lora_samples(without.render_prometheus(SchedulerStats()).decode()) == []


# ---- core-serve's flags ------------------------------------------------------------------------


def test_lora_modules_take_both_of_vllms_forms(monkeypatch):
    monkeypatch.delenv(RUNTIME_LORA_UPDATING_ENV, raising=False)
    json_form = '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'
    config, settings, _ = parse_args(
        [
            "null", "--served-model-name", "m", "--enable-lora", "--max-loras", "4",
            "--max-lora-rank", "64", "--lora-modules", "sql=/a/sql", json_form,
            "--lora-modules", "x=/a/b=c",
        ]
    )  # fmt: skip
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 64)
    assert settings.lora_modules == (
        LoRAModulePath("sql", "/a/sql"),
        LoRAModulePath("chat", "/a/chat", "m"),
        LoRAModulePath("x", "/a/b=c"),
    )
    assert settings.allow_runtime_lora_updating is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "sql=/a"], "--lora-modules needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "sql"], "'sql' is neither name=path nor"),
        (["--enable-lora", "--lora-modules", "{bad"], "'{bad' is not valid JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs a non-empty string 'path'"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/a", "x": 1}'], "'x'"),
        (["--enable-lora", "--lora-modules", "a=/1", "a=/2"], "names a more than once"),
    ],
)
def test_bad_lora_flags_are_usage_errors_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["null", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env_value", "flag", "allowed"),
    [
        (None, False, False),
        ("1", False, True),
        ("True", False, True),
        (" TRUE ", False, True),
        ("0", False, False),
        ("yes", False, False),
        (None, True, True),
    ],
)
def test_runtime_lora_updating_follows_vllms_switch_or_our_flag(
    env_value, flag, allowed, monkeypatch
):
    if env_value is None:
        monkeypatch.delenv(RUNTIME_LORA_UPDATING_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNTIME_LORA_UPDATING_ENV, env_value)
    flags = ["--allow-runtime-lora-updating"] if flag else []
    _, settings, _ = parse_args(["null", "--enable-lora", *flags])
    assert settings.allow_runtime_lora_updating is allowed
