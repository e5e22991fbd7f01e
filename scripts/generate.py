"""Generate text in one process: the engine core steps a worker in this process, no IPC.

    python scripts/generate.py [--model PATH] [--device cpu|cuda] [--max-tokens N]
        [--temperature T] [--seed S] [--ignore-eos] [--max-num-batched-tokens N]
        [--num-gpu-blocks-override N] [--no-enable-prefix-caching]
        [--speculative-config JSON] PROMPT...

All prompts run as one continuously batched workload; one JSON object per prompt is printed,
in order: {"prompt", "text", "token_ids" (generated only), "finish_reason"}. The engine is
`core.in_process_engine.InProcessEngine` over a `worker.local_executor.LocalExecutor`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from core_engine.common.dtypes import DTYPE_NAMES
from core_engine.common.model_files import resolve_model_path
from core_engine.core.in_process_engine import GenerationOutput, InProcessEngine
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import SamplingParams, SchedulerStats
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.speculative_config import SpeculativeConfig
from core_engine.worker.local_executor import LocalExecutor


def generate(
    prompts: Sequence[str], config: EngineConfig, sampling_params: SamplingParams
) -> GenerationOutput:
    """Text prompts in, text out: the model's tokenizer (no chat template), one workload."""
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    engine = InProcessEngine(config, LocalExecutor(config))
    return engine.generate_text(prompts, tokenizer, sampling_params)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    sampling_params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative_config=args.speculative_config,
    )
    output = generate(args.prompts, config, sampling_params)
    for prompt, result in zip(args.prompts, output.results, strict=True):
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    stats = output.stats
    print(
        f"{stats.num_steps} steps, {stats.num_generation_tokens} tokens in {output.elapsed_s:.2f} s, "
        f"{stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hit tokens"
        + _spec_decode_summary(stats),
        file=sys.stderr,
    )
    return 0


def _spec_decode_summary(stats: SchedulerStats) -> str:
    if stats.spec_decode_num_drafts == 0:
        return ""
    return (
        f", {stats.spec_decode_num_draft_tokens} draft tokens, acceptance rate "
        f"{stats.spec_decode_acceptance_rate:.1%}, mean acceptance length "
        f"{stats.spec_decode_mean_acceptance_length:.2f}"
    )


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=DTYPE_NAMES)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='vLLM\'s, e.g. {"method": "ngram", "num_speculative_tokens": 4}',
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
