"""The prefill/decode handshake: `kv_transfer_params` validated on the request, carried to the
core inside SamplingParams and back on the final output; the TcpConnector's options and the
engine settings it refuses; transfer hashes that two processes agree on whatever their seeds."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from core_engine.common.block_hash import NONE_HASH, prompt_block_hashes, transfer_block_hashes
from core_engine.proto import EngineCoreOutput, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.kv_transfer import KVTransferConfig
from core_engine.proto.kv_transfer_params import KVTransferParams
from core_engine.proto.parameter_error import ParameterError

REMOTE = {
    "do_remote_prefill": True,
    "remote_engine_id": "e1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "cmpl-1-0",
    "remote_block_ids": [3, 4],
    "remote_block_hashes": ["00" * 16, "ff" * 16],
}


def test_remote_prefill_params_parse_and_survive_the_wire_inside_sampling_params():
    params = KVTransferParams.parse(REMOTE)
    assert params.block_hashes == [b"\0" * 16, b"\xff" * 16]
    assert params.to_json_object() == REMOTE
    sampling = SamplingParams(max_tokens=5, kv_transfer_params=params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(sampling), type=SamplingParams)
    assert decoded.kv_transfer_params == params
    output = EngineCoreOutput("r", [1], kv_transfer_params=params)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=EngineCoreOutput) == output


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_host": None}, "remote_host is required"),
        ({"remote_port": 0}, r"remote_port must be in \[1, 65535\]"),
        ({"remote_block_hashes": ["00" * 16]}, "2 remote_block_ids but 1 remote_block_hashes"),
        ({"remote_block_hashes": ["00" * 16, "xyz"]}, "32 hex digits"),
        ({"do_remote_decode": True}, "exclude each other"),
        ({"remote_blocks": [1]}, "remote_blocks"),
    ],
)
def test_bad_params_are_refused_naming_the_field(change, message):
    with pytest.raises(ParameterError, match="kv_transfer_params") as info:
        KVTransferParams.parse({**REMOTE, **change})
    assert info.match(message)
    assert info.value.param == "kv_transfer_params"  # a 400 naming the field, never a 500


def test_an_unknown_field_alone_is_a_parameter_error():
    """Found by the server's fuzz test: an object of unknown fields only was a 500."""
    with pytest.raises(ParameterError, match="unknown field `logits_processors`") as info:
        KVTransferParams.parse({"logits_processors": [False]})
    assert info.value.param == "kv_transfer_params"


def test_kv_transfer_params_need_one_sequence():
    with pytest.raises(ValueError, match="n must be 1, got 2"):
        SamplingParams(n=2, kv_transfer_params=KVTransferParams(do_remote_decode=True))


def test_transfer_hashes_ignore_the_prefix_hash_seed_but_not_the_tokens_or_salt():
    tokens = list(range(40))
    code = (
        "from common.block_hash import transfer_block_hashes as t; "
        "print(','.join(h.hex() for h in t(list(range(40)), 16)))"
    )
    seen = set()
    for seed in ("0" * 32, "f" * 32):
        env = {**os.environ, "CORE_ENGINE_PREFIX_HASH_SEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen.add(result.stdout.strip())
    mine = ",".join(h.hex() for h in transfer_block_hashes(tokens, 16))
    assert seen == {mine}
    assert len(transfer_block_hashes(tokens, 16)) == 2
    assert transfer_block_hashes(tokens, 16) != prompt_block_hashes(tokens, 16, NONE_HASH)
    assert transfer_block_hashes(tokens, 16, "salt") != transfer_block_hashes(tokens, 16)
    assert transfer_block_hashes([1, *tokens[1:]], 16)[1] != transfer_block_hashes(tokens, 16)[1]


def tcp(role: str = "kv_both", **extra) -> dict:
    return {"kv_connector": "TcpConnector", "kv_role": role, "kv_connector_extra_config": extra}


def test_tcp_connector_options_have_defaults_and_roles():
    config = KVTransferConfig.parse(tcp("kv_producer", port=5600))
    assert config.tcp_option("port") == 5600 and config.tcp_option("host") == "127.0.0.1"
    assert config.is_kv_producer and not config.is_kv_consumer
    assert KVTransferConfig.parse(tcp("kv_both")).is_kv_consumer


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_transfer_config": tcp(hots="x")}, r"unknown keys \['hots'\]"),
        ({"kv_transfer_config": tcp(port=70000)}, r"port must be in \[0, 65535\]"),
        ({"kv_transfer_config": tcp(send_timeout_s=0)}, "send_timeout_s must be a positive"),
        ({"kv_transfer_config": tcp(), "tensor_parallel_size": 2}, "tensor_parallel_size 1, got 2"),
        (
            {"kv_transfer_config": tcp("kv_consumer"), "enable_prefix_caching": False},
            "needs enable_prefix_caching",
        ),
        (
            {"kv_transfer_config": tcp(port=5600), "data_parallel_size": 2},
            "port must be 0",
        ),
    ],
)
def test_bad_tcp_connector_settings_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
