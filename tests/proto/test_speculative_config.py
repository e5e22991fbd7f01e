"""SpeculativeConfig: vLLM's fields, validated wherever a config comes from (dict, JSON flag,
msgpack), every error naming the field."""

import argparse

import pytest

from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.speculative_config import SpeculativeConfig


def parse_flags(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_json_flag_round_trips_through_msgpack():
    config = parse_flags(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
    )
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_window) == ("ngram", 4, (2, 3))
    assert EngineConfig.from_b64(config.to_b64()).speculative_config == spec
    assert parse_flags("--speculative-config", "none").speculative_config is None


def test_dict_is_validated_in_engine_config():
    config = EngineConfig(speculative_config={"method": "suffix"})
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.num_lookahead_tokens == 24
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, r"method must be one of \('ngram', 'suffix'\), got 'eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens is required for method 'ngram'"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            r"num_speculative_tokens must be in \[1, 32\], got 0",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min=4 is above prompt_lookup_max=3",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "disable_by_batch_size must be at least 2",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
            r"suffix_decoding_min_token_prob must be in \[0, 1\], got 1.5",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
            "unknown field `lookahead`",
        ),
        ({"method": "ngram", "num_speculative_tokens": "many"}, "Expected `int | null`, got `str`"),
    ],
)
def test_bad_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_bad_json_flag_is_a_clear_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_flags("--speculative-config", "{method: ngram}")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        parse_flags("--speculative-config", "[4]")


def test_drafting_stops_at_32_running_requests_by_default_and_never_with_null():
    default = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert default.disable_by_batch_size == 32
    never = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    )
    assert never.disable_by_batch_size is None


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (
            {"method": "ngram", "num_speculative_tokens": 3},
            "speculative decoding: ngram (prompt lookup of 2-5 tokens), up to K=3 draft tokens "
            "per request, in steps of fewer than 32 requests",
        ),
        (
            {"method": "suffix", "disable_by_batch_size": None},
            "speculative decoding: suffix, up to K=24 draft tokens (tree depth 24, 1x the match, "
            "token probability >= 0.1) per request, in every step",
        ),
    ],
)
def test_the_start_up_line_names_the_method_and_k(value, line):
    assert SpeculativeConfig.parse(value).describe() == line
