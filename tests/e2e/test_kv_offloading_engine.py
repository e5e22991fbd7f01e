"""The offloading tiers under the default model: a prompt whose prefix a tiny pool evicted is
served from the host tier, and from the disk tier after a restart of the engine processes, with
the greedy tokens of an engine that recomputes it."""

from __future__ import annotations

import re

import pytest

from core_engine.common.block_hash import PREFIX_HASH_SEED_ENV
from core_engine.frontend import EngineClient
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.engine_helpers import in_process_engine

BLOCK_SIZE = 16
# 16 usable blocks of 16 tokens: the pool holds one request of max_model_len=256 at a time.
POOL = dict(num_gpu_blocks_override=17, max_model_len=256, block_size=BLOCK_SIZE, device="cpu")
PROMPT = [(i * 37) % 4000 + 100 for i in range(100)]  # 6 full blocks and 4 tokens
EVICTOR = [(i * 53) % 4000 + 200 for i in range(240)]  # with its 8 tokens: the whole pool
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HIT_TOKENS = 6 * BLOCK_SIZE


def run_prompt_evictor_prompt(config: EngineConfig):
    engine = in_process_engine(config)
    first = engine.generate([PROMPT], GREEDY)
    engine.generate([EVICTOR], GREEDY)
    again = engine.generate([PROMPT], GREEDY)
    return first, again


def test_an_evicted_prefix_is_served_from_the_host_tier_with_the_same_greedy_tokens():
    """The first run computes the prompt in full (the tier is empty): the reference."""
    computed, loaded = run_prompt_evictor_prompt(EngineConfig(**POOL, kv_offloading_size=0.1))
    assert computed.stats.external_prefix_cache_hits == 0
    assert loaded.stats.prefix_cache_hits == 0  # the pool really lost the prefix
    assert loaded.stats.external_prefix_cache_hits == HIT_TOKENS
    assert loaded.stats.external_prefix_cache_queries == len(PROMPT)
    assert loaded.stats.kv_offload_loaded_bytes > 0
    assert loaded.results[0].token_ids == computed.results[0].token_ids


def test_the_disk_tier_serves_a_prefix_after_the_engine_restarts(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(PREFIX_HASH_SEED_ENV, "0123456789abcdef0123456789abcdef")
    config = EngineConfig(**POOL, kv_offloading_size=0.1, kv_offloading_path=str(tmp_path))
    with EngineClient(config) as client:
        (cold,) = client.generate(PROMPT, GREEDY, stream=False)
        assert client.get_stats().external_prefix_cache_hits == 0
    # The engine core's start-up line (its log goes to the inherited stderr) gives both tiers.
    start_up = capfd.readouterr().err
    assert "KV offloading (OffloadingConnector): host tier 0.10 GiB = " in start_up
    assert re.search(r"disk tier [\d.]+ GiB = \d+ blocks of 16 tokens", start_up), start_up
    # 100 prompt tokens and 7 computed generated ones fill 6 blocks, each written once.
    assert len(list(tmp_path.rglob("*.kv"))) == 6
    with EngineClient(config) as client:
        (warm,) = client.generate(PROMPT, GREEDY, stream=False)
        stats = client.get_stats()
    assert stats.external_prefix_cache_hits == HIT_TOKENS
    assert stats.kv_offload_disk_bytes == stats.kv_offload_loaded_bytes  # those 6 blocks
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_transfer_config": '{"kv_connector": "Nope"}'}, "kv_connector must be one of"),
        ({"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "kv_offloading_size"),
        ({"kv_offloading_path": "/tmp/x"}, "set kv_offloading_size too"),
        ({"kv_offloading_size": -1.0}, "kv_offloading_size must be positive"),
        (
            {
                "kv_offloading_size": 1.0,
                "kv_transfer_config": {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {"disk_gib": 3},
                },
            },
            r"unknown keys \['disk_gib'\]",
        ),
        ({"model": "null", "kv_offloading_size": 1.0}, "null model has no KV cache"),
    ],
)
def test_bad_kv_transfer_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_kv_offloading_size_alone_means_the_offloading_connector_and_survives_the_wire():
    config = EngineConfig(kv_offloading_size=2.5, kv_offloading_path="/var/kv")
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert config.kv_transfer_config.kv_role == "kv_both"
    assert EngineConfig.from_b64(config.to_b64()) == config


def test_the_tier_metrics_have_vllms_names_under_our_prefix():
    from core_engine.frontend.metrics import EngineMetrics
    from core_engine.proto import SchedulerStats

    stats = SchedulerStats(
        external_prefix_cache_queries=100,
        external_prefix_cache_hits=96,
        kv_offload_host_bytes=4096,
        kv_offload_loaded_bytes=2048,
        kv_offload_load_s=0.25,
    )
    text = EngineMetrics("m").render_prometheus(stats).decode()
    assert 'core:external_prefix_cache_queries_total{model_name="m"} 100.0' in text
    assert 'core:external_prefix_cache_hits_total{model_name="m"} 96.0' in text
    assert 'core:kv_offload_host_bytes_used{model_name="m"} 4096.0' in text
    assert 'core:kv_offload_loaded_bytes_total{model_name="m"} 2048.0' in text
    assert 'core:kv_offload_load_seconds_total{model_name="m"} 0.25' in text


def test_the_kv_flags_reach_the_engine_config():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        [
            "--kv-transfer-config",
            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"disk_size_gib": 2}}',
            "--kv-offloading-size",
            "4",
            "--kv-offloading-path",
            "/var/kv",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.kv_offloading_size == 4.0
    assert config.kv_offloading_path == "/var/kv"
    assert config.kv_transfer_config.disk_size_gib == 2
