"""KV cache memory of Gemma 3 270M: hybrid groups against every layer at full attention.

Gemma 3 puts a 512-token sliding window on five of every six layers. With hybrid KV cache
groups (core/kv_cache/kv_cache_coordinator.py) those layers keep only the blocks inside their window;
with all-full groups every layer keeps the whole context. Both are measured with the core's own
`KVCacheManager`, driven the way the scheduler drives it: a request's prompt is computed in steps
of `--step-tokens` (`allocate_slots`, then its computed count advances, so blocks that leave the
window are freed as it goes), then it decodes one token.

Per context length (2k, 8k, 32k): the KV bytes one request holds, and the largest number of
such requests a KV budget of `--kv-budget-gib` holds at once (admitted one after another until
`allocate_slots` refuses). The ratio hybrid / all-full is printed and written with the figures
to benchmarks/results/kv_memory.{json,md}.

Layout as in vLLM: layers are grouped in runs of the smallest count of any attention type (3
global layers here), so a block holds the KV of 3 layers, the global layers form one
full-attention group and the 15 window layers five sliding-window groups. All-full is the same
6 groups, all with full attention.

Then offline throughput at a fixed KV budget with long prompts: the real engine (`LLM`, default
dtype and threads) generates the same greedy, ignore_eos workload (`--num-prompts` prompts of
`--prompt-tokens` tokens, `--max-tokens` each) twice in one run, with hybrid groups and with
`disable_hybrid_kv_cache=True` (one full-attention group of every layer, which vLLM calls
`--disable-hybrid-kv-cache-manager`; attention masks the window either way, so the tokens are
the same). Both get the same KV bytes (`CORE_ENGINE_KV_CACHE_MEMORY_BYTES`): what
`budget_requests` all-full requests hold at full length. What differs is how many requests those
bytes let run at once.

    python -m benchmarks.kv.memory [--kv-budget-gib 1] [--dtype-bytes 4] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.common import (
    RESULTS_DIR,
    GenerationWorkload,
    exact_length_prompt,
    machine_info,
    markdown_table,
    result_name,
    write_results,
)
from core_engine.common.gguf_file import GGUFFile
from core_engine.common.math_utils import cdiv
from core_engine.common.model_files import gemma3_270m_model_path
from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from core_engine.core.request import Request
from core_engine.proto import SamplingParams
from core_engine.worker.memory_profiler import KV_CACHE_MEMORY_BYTES_ENV

BLOCK_SIZE = 16
CONTEXT_LENGTHS = (2048, 8192, 32768)
# Gemma 3 makes every 6th layer global; the GGUF does not store the pattern (llama.cpp fixes it
# for the architecture too).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizes a model's KV cache: its layers' attention types and one token's KV per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    global_layer_every: int

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        gguf = GGUFFile(path)
        arch = gguf.field("general.architecture")
        return cls(
            num_layers=gguf.field(f"{arch}.block_count"),
            num_kv_heads=gguf.field(f"{arch}.attention.head_count_kv"),
            head_dim=gguf.field(f"{arch}.attention.key_length"),
            sliding_window=gguf.field(f"{arch}.attention.sliding_window"),
            global_layer_every=GEMMA3_SLIDING_WINDOW_PATTERN,
        )

    @property
    def num_global_layers(self) -> int:
        return self.num_layers // self.global_layer_every

    @property
    def layers_per_group(self) -> int:
        return math.gcd(self.num_global_layers, self.num_layers - self.num_global_layers)

    def bytes_per_block(self, dtype_bytes: int) -> int:
        """K and V of `layers_per_group` layers for BLOCK_SIZE tokens."""
        per_token_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        return self.layers_per_group * BLOCK_SIZE * per_token_layer

    def kv_cache_config(self, hybrid: bool, max_model_len: int) -> KVCacheConfig:
        num_global_groups = self.num_global_layers // self.layers_per_group
        num_window_groups = (self.num_layers - self.num_global_layers) // self.layers_per_group
        window = (
            SlidingWindowSpec(BLOCK_SIZE, min(self.sliding_window, max_model_len))
            if hybrid
            else FullAttentionSpec(BLOCK_SIZE)
        )
        groups = (FullAttentionSpec(BLOCK_SIZE),) * num_global_groups + (window,) * (
            num_window_groups
        )
        return KVCacheConfig(groups, max_model_len)


def make_manager(shape: ModelShape, hybrid: bool, context: int, num_blocks: int) -> KVCacheManager:
    max_model_len = context + 1
    config = shape.kv_cache_config(hybrid, max_model_len)
    # No prefix caching: each request's memory is its own.
    return KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len, False, config)


def run_request(
    manager: KVCacheManager, request_id: str, context: int, step_tokens: int, rng: random.Random
) -> bool:
    """Computes a `context`-token prompt in steps and decodes one token; False when the pool
    refuses a step (the request is then freed)."""
    prompt = [rng.randrange(1, 32000) for _ in range(context)]
    request = Request(request_id, prompt, SamplingParams(max_tokens=1), block_size=BLOCK_SIZE)
    while request.num_computed_tokens < context + 1:
        num_new_tokens = min(step_tokens, context + 1 - request.num_computed_tokens)
        if manager.allocate_slots(request, num_new_tokens) is None:
            manager.free(request)
            return False
        request.num_computed_tokens += num_new_tokens
    return True


def held_blocks(manager: KVCacheManager, request_id: str) -> int:
    return sum(
        1 for group in manager.get_blocks(request_id).blocks for block in group if not block.is_null
    )


def measure(
    shape: ModelShape, context: int, hybrid: bool, args: argparse.Namespace
) -> dict[str, float]:
    bytes_per_block = shape.bytes_per_block(args.dtype_bytes)
    num_blocks = blocks_per_request(shape, context, hybrid, args.step_tokens)
    budget_blocks = int(args.kv_budget_gib * GiB) // bytes_per_block
    num_admitted = concurrent_requests(shape, context, hybrid, budget_blocks, args.step_tokens)
    return {
        "blocks_per_request": num_blocks,
        "kv_bytes_per_request": num_blocks * bytes_per_block,
        "max_concurrent_requests": num_admitted,
    }


def blocks_per_request(shape: ModelShape, context: int, hybrid: bool, step_tokens: int) -> int:
    """Blocks one request holds after its `context`-token prompt and one decoded token."""
    num_groups = shape.num_layers // shape.layers_per_group
    roomy = make_manager(shape, hybrid, context, num_groups * cdiv(context + 1, BLOCK_SIZE) + 2)
    assert run_request(roomy, "one", context, step_tokens, random.Random(0))
    return held_blocks(roomy, "one")


def concurrent_requests(
    shape: ModelShape, context: int, hybrid: bool, budget_blocks: int, step_tokens: int
) -> int:
    """How many `context`-token requests `budget_blocks` blocks hold at once."""
    rng = random.Random(0)
    pool = make_manager(shape, hybrid, context, budget_blocks + 1)  # + the null block
    num_admitted = 0
    while run_request(pool, f"r{num_admitted}", context, step_tokens, rng):
        num_admitted += 1
    return num_admitted


# ---- offline throughput at a fixed KV budget -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThroughputShape:
    """The long-prompt workload; `--quick` shrinks it."""

    num_prompts: int
    prompt_tokens: int
    max_tokens: int
    budget_requests: int


FULL_THROUGHPUT = ThroughputShape(
    num_prompts=12, prompt_tokens=1024, max_tokens=192, budget_requests=3
)
QUICK_THROUGHPUT = ThroughputShape(
    num_prompts=4, prompt_tokens=640, max_tokens=16, budget_requests=1
)


def long_prompt_workload(llm, shape: ThroughputShape, seed: int) -> GenerationWorkload:
    rng = random.Random(f"{seed}-long-prompts")
    encode = llm.get_tokenizer().encode
    return GenerationWorkload(
        "long-prompts",
        f"{shape.num_prompts} prompts of {shape.prompt_tokens} tokens, {shape.max_tokens} each",
        [exact_length_prompt(rng, encode, shape.prompt_tokens) for _ in range(shape.num_prompts)],
        [shape.max_tokens] * shape.num_prompts,
    )


def measure_throughput(
    model_path: Path, model_shape: ModelShape, shape: ThroughputShape, args: argparse.Namespace
) -> dict:
    """Hybrid vs all-full `LLM.generate` on one workload and one KV block budget."""
    from benchmarks.offline.bench import run_engine
    from core_engine.frontend import LLM

    context = shape.prompt_tokens + shape.max_tokens
    bytes_per_block = model_shape.bytes_per_block(args.dtype_bytes)
    budget_blocks = shape.budget_requests * blocks_per_request(
        model_shape, context, False, args.step_tokens
    )
    num_groups = model_shape.num_layers // model_shape.layers_per_group
    # The null block: a block of every layer when all layers form one group.
    budget_bytes = (budget_blocks + num_groups) * bytes_per_block
    engine_args = dict(
        dtype={4: "float32", 2: "bfloat16"}[args.dtype_bytes],
        max_model_len=context,
        max_num_batched_tokens=args.step_tokens,
    )
    record: dict = {
        "workload": dataclasses.asdict(shape),
        "budget_blocks": budget_blocks,
        "budget_mib": budget_blocks * bytes_per_block / 2**20,
    }
    outputs = {}
    for name, hybrid in (("hybrid", True), ("all_full", False)):
        # The engine sizes its cache from this byte budget, as a CPU user sets it.
        os.environ[KV_CACHE_MEMORY_BYTES_ENV] = str(budget_bytes)
        with LLM(str(model_path), disable_hybrid_kv_cache=not hybrid, **engine_args) as llm:
            workload = long_prompt_workload(llm, shape, args.seed)
            elapsed_s, outputs[name] = run_engine(llm, workload)
        record[name] = {
            "seconds": elapsed_s,
            "output_tokens_per_s": workload.num_output_tokens / elapsed_s,
            "requests_at_once": concurrent_requests(
                model_shape, context, hybrid, budget_blocks, args.step_tokens
            ),
        }
        print(f"{name}: {record[name]['output_tokens_per_s']:.1f} output tok/s ({elapsed_s:.1f} s)")
    record["speedup"] = (
        record["hybrid"]["output_tokens_per_s"] / record["all_full"]["output_tokens_per_s"]
    )
    record["same_tokens"] = sum(
        a == b for a, b in zip(outputs["hybrid"], outputs["all_full"], strict=True)
    )
    return record


def throughput_markdown(record: dict, args: argparse.Namespace) -> str:
    shape = record["workload"]
    header = ["KV cache", "requests at once", "seconds", "output tok/s", "vs all-full"]
    rows = [
        [
            name.replace("_", "-"),
            record[name]["requests_at_once"],
            f"{record[name]['seconds']:.1f}",
            f"{record[name]['output_tokens_per_s']:.1f}",
            f"{record[name]['output_tokens_per_s'] / record['all_full']['output_tokens_per_s']:.2f}x",
        ]
        for name in ("hybrid", "all_full")
    ]
    return (
        f"### Offline throughput at a fixed KV budget: {shape['num_prompts']} prompts of "
        f"{shape['prompt_tokens']} tokens, {shape['max_tokens']} output tokens each (greedy, "
        f"ignore_eos), {record['budget_blocks']} blocks ({record['budget_mib']:.0f} MiB at "
        f"{args.dtype_bytes}-byte KV: {shape['budget_requests']} all-full requests at full "
        f"length), steps of {args.step_tokens} tokens\n\n"
        + markdown_table(header, rows)
        + f"\n\n'requests at once' is what the core's KVCacheManager admits in that budget at "
        f"full length. Same greedy tokens from both: {record['same_tokens']} of "
        f"{shape['num_prompts']} requests.\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-budget-gib", type=float, default=1.0)
    parser.add_argument("--dtype-bytes", type=int, default=4, help="4: float32 KV, 2: bf16")
    parser.add_argument("--step-tokens", type=int, default=1024, help="prompt tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--quick", action="store_true", help="a small throughput workload (smoke test)"
    )
    parser.add_argument(
        "--skip-throughput", action="store_true", help="only the memory figures (no model run)"
    )
    args = parser.parse_args(argv)
    model_path = gemma3_270m_model_path()
    shape = ModelShape.from_gguf(model_path)
    rows, results = [], []
    for context in CONTEXT_LENGTHS:
        hybrid = measure(shape, context, True, args)
        full = measure(shape, context, False, args)
        memory_ratio = full["kv_bytes_per_request"] / hybrid["kv_bytes_per_request"]
        results.append({"context": context, "hybrid": hybrid, "all_full": full})
        rows.append(
            [
                context,
                f"{hybrid['kv_bytes_per_request'] / 2**20:.1f}",
                f"{full['kv_bytes_per_request'] / 2**20:.1f}",
                f"{memory_ratio:.2f}x",
                hybrid["max_concurrent_requests"],
                full["max_concurrent_requests"],
            ]
        )
        print(
            f"context {context}: KV per request {hybrid['kv_bytes_per_request'] / 2**20:.1f} MiB "
            f"hybrid vs {full['kv_bytes_per_request'] / 2**20:.1f} MiB all-full "
            f"({memory_ratio:.2f}x less); in {args.kv_budget_gib:g} GiB: "
            f"{hybrid['max_concurrent_requests']} vs {full['max_concurrent_requests']} requests"
        )
    header = [
        "context (tokens)",
        "hybrid MiB/request",
        "all-full MiB/request",
        "all-full / hybrid",
        f"hybrid requests in {args.kv_budget_gib:g} GiB",
        f"all-full requests in {args.kv_budget_gib:g} GiB",
    ]
    markdown = (
        f"### KV cache memory: Gemma 3 270M ({shape.num_layers} layers, "
        f"{shape.num_layers - shape.num_global_layers} with a {shape.sliding_window}-token "
        f"window), {args.dtype_bytes}-byte KV, blocks of {BLOCK_SIZE}, prompt steps of "
        f"{args.step_tokens}\n\n" + markdown_table(header, rows)
    )
    throughput = None
    if not args.skip_throughput:
        shape_run = QUICK_THROUGHPUT if args.quick else FULL_THROUGHPUT
        throughput = measure_throughput(model_path, shape, shape_run, args)
        markdown += "\n" + throughput_markdown(throughput, args)
    result = {
        "model": str(model_path.name),
        "shape": dataclasses.asdict(shape),
        "kv_budget_gib": args.kv_budget_gib,
        "dtype_bytes": args.dtype_bytes,
        "step_tokens": args.step_tokens,
        "results": results,
        "throughput": throughput,
        "machine": machine_info(),
    }
    name = result_name("kv_memory", args.quick)
    print(write_results(result, markdown, args.output_dir, name))


if __name__ == "__main__":
    main()
