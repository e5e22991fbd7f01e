"""Offline throughput: `LLM.generate` against Hugging Face transformers' batched `generate`.

Same model weights (the default SmolLM2 GGUF, and for transformers the same GGUF converted to an
HF folder by transformers itself), same dtype, same device, same seeded token-id prompts, greedy,
ignore_eos. transformers runs what a transformers user runs: batches of `--hf-batch-size`
prompts, left padded, generated to the longest `max_tokens` of the batch, then each output cut
to its own `max_tokens`. Only useful output tokens (the sum of `max_tokens`) are counted.

Workloads:
- mixed: 48 prompts of 10-200 words, each with its own max_tokens in [16, 160] (goal: the
  engine at least 2x transformers);
- decode-heavy: short prompts (5-15 words), 256 tokens each;
- prefill-heavy: 1,000-token prompts, 16 tokens each.

Also reported: for how many requests both produced the same first tokens (same work done).

    python -m scripts.bench_offline [--quick] [--device cuda] [--workloads mixed decode]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from frontend import LLM, SamplingParams
from scripts.bench_common import (
    RESULTS_DIR,
    GenerationWorkload,
    exact_length_prompt,
    machine_info,
    markdown_table,
    result_name,
    word_prompts,
    write_results,
)

TARGET_SPEEDUP = 2.0
NUM_COMPARED_TOKENS = 8
WORKLOAD_NAMES = ("mixed", "decode", "prefill")
GPU_NUM_PROMPTS = 256


@dataclass(slots=True, frozen=True)
class WorkloadShape:
    """How big each workload is; `--quick` shrinks every dimension."""

    num_mixed: int
    mixed_words: tuple[int, int]
    mixed_max_tokens: tuple[int, int]
    num_decode: int
    decode_max_tokens: int
    num_prefill: int
    prefill_prompt_tokens: int
    prefill_max_tokens: int


FULL_SHAPE = WorkloadShape(48, (10, 200), (16, 160), 32, 256, 16, 1000, 16)
QUICK_SHAPE = WorkloadShape(6, (10, 60), (4, 12), 4, 16, 2, 200, 4)


def build_workloads(
    shape: WorkloadShape, encode, seed: int, names: list[str], num_prompts: int | None
) -> list[GenerationWorkload]:
    """The seeded workloads, as token ids from `encode` (the model's tokenizer)."""
    builders = {
        "mixed": lambda rng: _mixed(shape, encode, rng, num_prompts or shape.num_mixed),
        "decode": lambda rng: _decode(shape, encode, rng, num_prompts or shape.num_decode),
        "prefill": lambda rng: _prefill(shape, encode, rng, num_prompts or shape.num_prefill),
    }
    return [builders[name](random.Random(f"{seed}-{name}")) for name in names]


def _mixed(shape, encode, rng, num_prompts) -> GenerationWorkload:
    texts = word_prompts(rng, num_prompts, *shape.mixed_words)
    low, high = shape.mixed_max_tokens
    return GenerationWorkload(
        "mixed",
        f"{num_prompts} prompts of {shape.mixed_words[0]}-{shape.mixed_words[1]} words, "
        f"max_tokens {low}-{high}",
        [encode(text) for text in texts],
        [rng.randint(low, high) for _ in texts],
    )


def _decode(shape, encode, rng, num_prompts) -> GenerationWorkload:
    texts = word_prompts(rng, num_prompts, 5, 15)
    return GenerationWorkload(
        "decode-heavy",
        f"{num_prompts} prompts of 5-15 words, {shape.decode_max_tokens} tokens each",
        [encode(text) for text in texts],
        [shape.decode_max_tokens] * num_prompts,
    )


def _prefill(shape, encode, rng, num_prompts) -> GenerationWorkload:
    length = shape.prefill_prompt_tokens
    return GenerationWorkload(
        "prefill-heavy",
        f"{num_prompts} prompts of {length} tokens, {shape.prefill_max_tokens} tokens each",
        [exact_length_prompt(rng, encode, length) for _ in range(num_prompts)],
        [shape.prefill_max_tokens] * num_prompts,
    )


# ---- the engine ------------------------------------------------------------------------------


def run_engine(llm: LLM, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
    """(seconds, output token ids per prompt) for one `LLM.generate` call over the workload."""
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for max_tokens in workload.max_tokens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompt_token_ids, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    for tokens, max_tokens in zip(token_ids, workload.max_tokens, strict=True):
        if len(tokens) != max_tokens:
            raise RuntimeError(f"the engine returned {len(tokens)} tokens, asked {max_tokens}")
    return elapsed_s, token_ids


# ---- the baseline: transformers --------------------------------------------------------------


class TransformersBaseline:
    """A transformers model with its tokenizer, generating greedy batches without eos stops."""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        self.model = model.to(self.device).eval()
        # ignore_eos: a GenerationConfig passed to generate() falls back to the model's
        # eos_token_id when it has none, so the model's own must go.
        self.model.generation_config.eos_token_id = None
        self.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def run(self, workload: GenerationWorkload, batch_size: int) -> tuple[float, list[list[int]]]:
        """(seconds, output token ids per prompt): batches in order, each to its longest."""
        start = time.perf_counter()
        token_ids: list[list[int]] = []
        for first in range(0, workload.num_prompts, batch_size):
            prompts = workload.prompt_token_ids[first : first + batch_size]
            max_tokens = workload.max_tokens[first : first + batch_size]
            token_ids += self._generate_batch(prompts, max_tokens)
        elapsed_s = time.perf_counter() - start
        return elapsed_s, token_ids

    def _generate_batch(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from transformers import GenerationConfig

        max_len = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), max_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, max_len - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, max_len - len(prompt) :] = 1
        config = GenerationConfig(
            max_new_tokens=max(max_tokens), do_sample=False, pad_token_id=self.pad_token_id
        )
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )
        generated = output[:, max_len:].tolist()
        if any(len(tokens) != max(max_tokens) for tokens in generated):
            raise RuntimeError("transformers stopped early although eos is disabled")
        cut = [tokens[:n] for tokens, n in zip(generated, max_tokens, strict=True)]
        self.tokenizer.batch_decode(cut)  # a user wants text; the engine detokenizes too
        return cut


def default_hf_folder(model: str | None) -> Path:
    """The transformers-loadable folder holding the same weights as the engine's `model`."""
    if model is not None and (Path(model) / "config.json").is_file():
        return Path(model)
    if model is not None:
        raise ValueError(
            f"model {model!r} is not a Hugging Face folder; pass --hf-model with the same "
            "weights as a transformers-loadable folder"
        )
    from tests.model_fixtures import converted_default_model_folder

    return converted_default_model_folder()


# ---- main ------------------------------------------------------------------------------------


def token_passes(workload: GenerationWorkload, hf_batch_size: int) -> tuple[int, int]:
    """(engine, transformers) token positions run through the model: the engine runs each
    prompt once and each request's own output tokens after the first; transformers pads each
    batch to its longest prompt and runs every row to the batch's longest max_tokens. Their
    ratio is the speedup at equal cost per token position (attention aside)."""
    engine = workload.num_prompt_tokens + sum(n - 1 for n in workload.max_tokens)
    transformers = 0
    for first in range(0, workload.num_prompts, hf_batch_size):
        prompts = workload.prompt_token_ids[first : first + hf_batch_size]
        longest_output = max(workload.max_tokens[first : first + hf_batch_size])
        transformers += len(prompts) * (max(map(len, prompts)) + longest_output - 1)
    return engine, transformers


def compare(
    llm: LLM,
    baseline: TransformersBaseline,
    workload: GenerationWorkload,
    hf_batch_size: int,
    device: str,
    repeats: int = 1,
) -> dict:
    """Runs the engine then transformers, `repeats` times; reports the pair whose ratio is the
    median, so a machine whose speed drifts between runs compares runs minutes apart."""
    pairs = []
    for _ in range(repeats):
        # A repeat must not find the previous one's prompts in the prefix cache.
        if not llm.reset_prefix_cache():
            raise RuntimeError("the engine refused to reset its prefix cache between repeats")
        engine_s, engine_tokens = run_engine(llm, workload)
        _synchronize(device)
        hf_s, hf_tokens = baseline.run(workload, hf_batch_size)
        _synchronize(device)
        pairs.append((engine_s, hf_s))
    engine_s, hf_s = median_pair(pairs)
    num_agreeing = sum(
        e[:NUM_COMPARED_TOKENS] == h[:NUM_COMPARED_TOKENS]
        for e, h in zip(engine_tokens, hf_tokens, strict=True)
    )
    num_tokens = workload.num_output_tokens
    engine_passes, hf_passes = token_passes(workload, hf_batch_size)
    row = {
        "workload": workload.name,
        "description": workload.description,
        "num_prompts": workload.num_prompts,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": num_tokens,
        "engine_s": engine_s,
        "transformers_s": hf_s,
        "engine_output_tokens_per_s": num_tokens / engine_s,
        "transformers_output_tokens_per_s": num_tokens / hf_s,
        "speedup": hf_s / engine_s,
        "pair_speedups": [hf / engine for engine, hf in pairs],
        "engine_token_passes": engine_passes,
        "transformers_token_passes": hf_passes,
        "work_ratio": hf_passes / engine_passes,
        "num_requests_first_tokens_agree": num_agreeing,
    }
    print(
        f"{workload.name}: engine {row['engine_output_tokens_per_s']:.1f} tok/s, transformers "
        f"{row['transformers_output_tokens_per_s']:.1f} tok/s, ratio {row['speedup']:.2f}x "
        f"({num_agreeing}/{workload.num_prompts} agree on the first {NUM_COMPARED_TOKENS} tokens; "
        f"pairs: {', '.join(f'{x:.2f}x' for x in row['pair_speedups'])})"
    )
    return row


def median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The (engine_s, transformers_s) pair with the median ratio (the lower one of two middles)."""
    ordered = sorted(pairs, key=lambda pair: pair[1] / pair[0])
    return ordered[(len(ordered) - 1) // 2]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(llm: LLM, baseline: TransformersBaseline) -> None:
    """First calls allocate and compile; neither side is timed on them."""
    prompts = [baseline.encode("Hello there, how are you today?")] * 2
    workload = GenerationWorkload("warm-up", "", prompts, [4, 4])
    run_engine(llm, workload)
    baseline.run(workload, 2)


def set_num_threads(num_threads: int) -> int:
    """Gives this process and the engine's workers (through OMP_NUM_THREADS, which they
    inherit) the same number of torch threads; returns it.

    The default is 1 because on a CPU shared with other jobs, OpenMP with more threads than
    idle cores spins at its barriers: a 2-thread matmul measured 40x slower than 1 thread on the
    2-core machine these results come from.
    """
    if num_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--model", default=None, help="engine model (default: SmolLM2 GGUF)")
    parser.add_argument("--hf-model", type=Path, default=None, help="same weights for HF")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOAD_NAMES),
                        choices=WORKLOAD_NAMES)  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"prompts per workload (default: the workload's; {GPU_NUM_PROMPTS} "
                        "on cuda)")  # fmt: skip
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="transformers batch size (default: all prompts of a workload)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="engine token budget per step (default: the engine's)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="engine share of GPU memory; the rest is for transformers",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, the same for both sides (0: torch's default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="engine/transformers pairs per workload, the median ratio reported (default: 3, "
        "1 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main() -> None:
    args = parse_args()
    num_threads = set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    num_prompts = args.num_prompts or (GPU_NUM_PROMPTS if args.device == "cuda" else None)
    machine = machine_info()
    hf_folder = args.hf_model or default_hf_folder(args.model)
    baseline = TransformersBaseline(hf_folder, args.device, getattr(torch, dtype_name))
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    workloads = build_workloads(shape, baseline.encode, args.seed, args.workloads, num_prompts)
    engine_args = {"max_num_seqs": args.max_num_seqs}
    if args.device == "cuda":
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows = []
    with LLM(args.model, device=args.device, dtype=dtype_name, **engine_args) as llm:
        warm_up(llm, baseline)
        for workload in workloads:
            batch_size = args.hf_batch_size or workload.num_prompts
            rows.append(
                compare(llm, baseline, workload, batch_size, args.device, repeats=args.repeats)
            )
            gc.collect()
    mixed = next((row for row in rows if row["workload"] == "mixed"), None)
    result = {
        "benchmark": "offline",
        "quick": args.quick,
        "machine": machine,
        "device": args.device,
        "dtype": dtype_name,
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 GGUF (default)",
        "transformers_model_folder": str(hf_folder),
        "transformers_batch_size": args.hf_batch_size or "all prompts of a workload",
        "engine_args": engine_args,
        "torch_num_threads": num_threads,
        "repeats": args.repeats,
        "seed": args.seed,
        "rows": rows,
        "target_speedup_mixed": TARGET_SPEEDUP,
        "mixed_speedup": mixed["speedup"] if mixed else None,
        "meets_target": bool(mixed and mixed["speedup"] >= TARGET_SPEEDUP),
    }
    name = "offline" if args.device == "cpu" else f"offline_{args.device}"
    write_results(result, render_markdown(result), args.output_dir, result_name(name, args.quick))


def render_markdown(result: dict) -> str:
    rows = [
        [
            f"{row['workload']} ({row['description']})",
            f"{row['engine_output_tokens_per_s']:.1f}",
            f"{row['transformers_output_tokens_per_s']:.1f}",
            f"**{row['speedup']:.2f}x**",
            f"{row['work_ratio']:.2f}x",
            f"{row['num_requests_first_tokens_agree']}/{row['num_prompts']}",
        ]
        for row in result["rows"]
    ]
    table = markdown_table(
        [
            "workload",
            "engine output tok/s",
            "transformers output tok/s",
            "engine / transformers",
            "token positions transformers / engine",
            f"same first {NUM_COMPARED_TOKENS} tokens",
        ],
        rows,
    )
    text = (
        f"### Offline throughput: `LLM.generate` vs transformers `generate` "
        f"({result['device']}, {result['dtype']})\n\n{table}\n\n"
        "Token positions: what each side runs through the model (transformers pads every prompt "
        "to its batch's longest and runs every row to the batch's longest max_tokens); their "
        "ratio is the speedup the engine gets from doing less work alone, at equal cost per "
        "position.\n"
    )
    repeats = result.get("repeats", 1)
    if repeats > 1:
        pairs = "; ".join(
            f"{row['workload']} " + ", ".join(f"{x:.2f}x" for x in row["pair_speedups"])
            for row in result["rows"]
        )
        text += (
            f"\nEach workload ran {repeats} engine/transformers pairs; the table shows the pair "
            f"with the median ratio (all pairs: {pairs}).\n"
        )
    if result["mixed_speedup"] is not None:
        text += (
            f"\nMixed workload: engine / transformers = **{result['mixed_speedup']:.2f}x** "
            f"(target >= {result['target_speedup_mixed']:.0f}x, "
            f"{'met' if result['meets_target'] else 'missed'}).\n"
        )
    return text


if __name__ == "__main__":
    main()
