"""Speculative decoding on a device: greedy tokens with and without n-gram drafts (float32,
random weights of a `gpu_engine_check` model shape; random prompts and prompts that repeat
themselves, so drafts are made and accepted), and a seeded sampled run with drafts done twice;
prints one JSON line and exits 1 when greedy tokens differ or the seeded runs do.

    python -m benchmarks.gpu.spec_decode_check --device cuda --model smollm2-135m
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu.engine_check import MODEL_SHAPES, random_prompts, write_random_model
from core_engine.core.in_process_engine import InProcessEngine
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.local_executor import LocalExecutor

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=48, ignore_eos=True)


def run(folder: Path, device: str, prompts, speculative, params):
    """(token ids per prompt, the workload's SchedulerStats, seconds) of one fresh engine."""
    config = EngineConfig(
        model=str(folder),
        device=device,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=256,
        speculative_config=speculative,
    )
    engine = InProcessEngine(config, LocalExecutor(config))
    start = time.perf_counter()
    output = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return [r.token_ids for r in output.results], output.stats, elapsed


def check(folder: Path, device: str, vocab_size: int) -> dict:
    prompts = random_prompts((7, 40, 150), vocab_size, seed=1)
    prompts += [p * 6 for p in random_prompts((12, 12), vocab_size, seed=2)]
    base, _, base_s = run(folder, device, prompts, None, GREEDY)
    drafted, stats, spec_s = run(folder, device, prompts, NGRAM, GREEDY)
    sampled, sampled_stats, _ = run(folder, device, prompts, NGRAM, SAMPLED)
    again, _, _ = run(folder, device, prompts, NGRAM, SAMPLED)
    return {
        "greedy_equal": base == drafted,
        "equal_per_prompt": [a == b for a, b in zip(base, drafted, strict=True)],
        "draft_tokens": stats.spec_decode_num_draft_tokens,
        "accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "seconds_no_spec": round(base_s, 2),
        "seconds_spec": round(spec_s, 2),
        "sampled_seeded_reproducible": sampled == again,
        "sampled_accepted": sampled_stats.spec_decode_num_accepted_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    args = parser.parse_args(argv)
    shape = MODEL_SHAPES[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_model(Path(tmp), shape, torch.device(args.device))
        result = {"device": args.device, "model": args.model}
        result |= check(folder, args.device, shape["vocab_size"])
    print(json.dumps(result))
    return 0 if result["greedy_equal"] and result["sampled_seeded_reproducible"] else 1


if __name__ == "__main__":
    sys.exit(main())
