"""The KV connector on a device (issue 36): the host tier, the disk tier across a restart and
prefill/decode disaggregation over TCP, each with real engine processes on random weights of a
`gpu_engine_check` model shape (float32), each against the greedy tokens of an engine that
computes the prompt itself; prints one JSON line and exits 1 when any differs or nothing came
from outside the pool.

    python -m benchmarks.gpu.kv_connector_check --device cuda --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu.engine_check import MODEL_SHAPES, random_prompts, write_random_model
from core_engine.common.block_hash import PREFIX_HASH_SEED_ENV
from core_engine.frontend import EngineClient
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.kv_transfer_params import KVTransferParams

BLOCK_SIZE = 16
# 16 usable blocks of 16 tokens: the pool holds one request of max_model_len=256 at a time.
SMALL_POOL = dict(num_gpu_blocks_override=17, max_model_len=256, block_size=BLOCK_SIZE)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_TOKENS, EVICTOR_TOKENS = 100, 240  # the evictor with its 8 tokens fills the pool


def config_for(folder: Path, device: str, **options) -> EngineConfig:
    return EngineConfig(model=str(folder), device=device, dtype="float32", **options)


def tokens_of(client: EngineClient, prompt, params: SamplingParams = GREEDY):
    (output,) = client.generate(prompt, params, stream=False)
    return output


def host_tier(folder: Path, device: str, prompt, evictor) -> dict:
    """Prompt, a prompt that evicts it from the pool, the prompt again: served from host memory."""
    config = config_for(folder, device, **SMALL_POOL, kv_offloading_size=0.1)
    with EngineClient(config) as client:
        computed = tokens_of(client, prompt).outputs[0].token_ids
        tokens_of(client, evictor)
        before = client.get_stats()
        loaded = tokens_of(client, prompt).outputs[0].token_ids
        after = client.get_stats()
    hits = after.external_prefix_cache_hits - before.external_prefix_cache_hits
    return {
        "equal": computed == loaded,
        "external_hit_tokens": hits,
        "loaded_bytes": after.kv_offload_loaded_bytes - before.kv_offload_loaded_bytes,
        "ok": computed == loaded and hits == (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE,
    }


def disk_tier(folder: Path, device: str, prompt, store: Path) -> dict:
    """The prompt in one engine, then in a new one over the same folder: served from disk."""
    os.environ[PREFIX_HASH_SEED_ENV] = "0123456789abcdef0123456789abcdef"
    options = dict(**SMALL_POOL, kv_offloading_size=0.1, kv_offloading_path=str(store))
    config = config_for(folder, device, **options)
    with EngineClient(config) as client:
        cold = tokens_of(client, prompt).outputs[0].token_ids
    files = len(list(store.rglob("*.kv")))
    with EngineClient(config) as client:
        warm = tokens_of(client, prompt).outputs[0].token_ids
        stats = client.get_stats()
    return {
        "equal": cold == warm,
        "files": files,
        "external_hit_tokens": stats.external_prefix_cache_hits,
        "loaded_bytes": stats.kv_offload_loaded_bytes,
        "ok": cold == warm and stats.external_prefix_cache_hits > 0,
    }


def disaggregated(folder: Path, device: str, prompts) -> dict:
    """Each prompt prefilled by a producer, pulled over TCP and decoded by a consumer, against
    the consumer computing it alone (another cache salt, so nothing is shared)."""
    pool = dict(num_gpu_blocks_override=128, max_model_len=512, block_size=BLOCK_SIZE)

    def tcp(role: str) -> EngineConfig:
        transfer = {"kv_connector": "TcpConnector", "kv_role": role}
        return config_for(folder, device, **pool, kv_transfer_config=transfer)

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    equal, pulled_seconds = [], []
    with EngineClient(tcp("kv_producer")) as producer, EngineClient(tcp("kv_consumer")) as consumer:
        for index, prompt in enumerate(prompts):
            reference = tokens_of(consumer, prompt, _salted(params, f"ref{index}"))
            ask = KVTransferParams(do_remote_decode=True)
            answer = tokens_of(producer, prompt, _with(params, max_tokens=1, transfer=ask))
            handover = KVTransferParams.parse(answer.kv_transfer_params)
            start = time.perf_counter()
            decoded = tokens_of(consumer, prompt, _with(params, transfer=handover))
            pulled_seconds.append(round(time.perf_counter() - start, 3))
            equal.append(decoded.outputs[0].token_ids == reference.outputs[0].token_ids)
        stats = consumer.get_stats()
    pulled = sum((len(p) // BLOCK_SIZE) * BLOCK_SIZE for p in prompts)
    return {
        "equal_per_prompt": equal,
        "external_hit_tokens": stats.external_prefix_cache_hits,
        "expected_hit_tokens_at_most": pulled,
        "loaded_bytes": stats.kv_offload_loaded_bytes,
        "decode_request_seconds": pulled_seconds,
        "ok": all(equal) and stats.external_prefix_cache_hits > 0,
    }


def _salted(params: SamplingParams, salt: str) -> SamplingParams:
    return SamplingParams(**{**_fields(params), "cache_salt": salt})


def _with(params: SamplingParams, *, transfer, max_tokens: int | None = None) -> SamplingParams:
    fields = _fields(params) | {"kv_transfer_params": transfer}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return SamplingParams(**fields)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    args = parser.parse_args(argv)
    shape = MODEL_SHAPES[args.model]
    prompt, evictor = random_prompts((PROMPT_TOKENS, EVICTOR_TOKENS), shape["vocab_size"], seed=3)
    pd_prompts = random_prompts((40, 150, 333), shape["vocab_size"], seed=4)
    result: dict = {"device": args.device, "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_model(Path(tmp), shape, torch.device("cpu"))
        for name, step in (
            ("host_tier", lambda: host_tier(folder, args.device, prompt, evictor)),
            ("disk_tier", lambda: disk_tier(folder, args.device, prompt, Path(tmp) / "kv")),
            ("disaggregated", lambda: disaggregated(folder, args.device, pd_prompts)),
        ):
            start = time.perf_counter()
            try:
                result[name] = step()
            except Exception as exc:  # recorded: the next step still runs
                result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps({name: result[name]}), flush=True)
    print(json.dumps(result))
    return 0 if all(result[n]["ok"] for n in ("host_tier", "disk_tier", "disaggregated")) else 1


if __name__ == "__main__":
    sys.exit(main())
