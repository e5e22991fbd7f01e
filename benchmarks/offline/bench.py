"""Offline throughput: `LLM.generate` against peers measured in the same run, on the same work.

Same model weights, same dtype (the engine's default unless --dtype), same threads (one per
usable core unless --threads), same device, same seeded token-id prompts with the same
max_tokens, greedy, ignore_eos. Only useful output tokens (the sum of `max_tokens`) are counted.
Each repeat runs the engine, then every peer, one at a time, so a machine whose speed drifts
compares runs seconds apart. Peers (`--peer`, one or more):
- transformers (default): batched `generate` in this process on the GGUF converted to an HF
  folder by transformers itself, as a transformers user runs it: batches of `--hf-batch-size`
  prompts, left padded, generated to the longest `max_tokens` of the batch, then each output cut
  to its own `max_tokens`;
- vllm: vLLM's `LLM.generate` in its own process under its own Python (`--peer-python`), on the
  same HF folder (see `benchmarks/peers/vllm.py`); never imported here;
- llama-server: llama.cpp's server on the GGUF file itself, all prompts sent at once over HTTP
  (see `benchmarks/peers/llama_server.py`); `--llama-server PATH` if it is not on PATH.

Workloads:
- mixed: 48 prompts of 10-200 words, each with its own max_tokens in [16, 160] (goal: the
  engine at least 2x transformers);
- decode-heavy: short prompts (5-15 words), 256 tokens each;
- prefill-heavy: 1,000-token prompts, 16 tokens each;
- burst: vLLM's saturation burst run offline: 64 prompts of 128 random token ids, 64 tokens each
  (what `vllm bench serve --dataset-name random` sends in `benchmarks/serving/vllm_client.py`).

Reported per workload and peer: both sides' output tokens/s, their ratio (engine / peer), and
for how many requests both produced the same first tokens (same work done).

    python -m benchmarks.offline.bench [--quick] [--peer transformers vllm] [--workloads mixed]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from benchmarks.harness.common import (
    RESULTS_DIR,
    GenerationWorkload,
    default_hf_folder,
    default_num_threads,
    engine_default_dtype,
    exact_length_prompt,
    machine_info,
    markdown_table,
    random_token_prompts,
    result_name,
    word_prompts,
    write_results,
)
from core_engine.common.dtypes import DTYPE_NAMES
from core_engine.frontend import LLM, SamplingParams

TARGET_SPEEDUP = 2.0
NUM_COMPARED_TOKENS = 8
DEFAULT_WORKLOADS = ("mixed", "decode", "prefill")
WORKLOAD_NAMES = (*DEFAULT_WORKLOADS, "burst")  # burst on request: --workloads burst
PEER_NAMES = ("transformers", "vllm", "llama-server")
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
    num_burst: int = 64
    burst_input_len: int = 128
    burst_output_len: int = 64


FULL_SHAPE = WorkloadShape(48, (10, 200), (16, 160), 32, 256, 16, 1000, 16)
QUICK_SHAPE = WorkloadShape(6, (10, 60), (4, 12), 4, 16, 2, 200, 4, 4, 32, 8)


def build_workloads(
    shape: WorkloadShape, encode, seed: int, names: list[str], num_prompts: int | None
) -> list[GenerationWorkload]:
    """The seeded workloads, as token ids from `encode` (the model's tokenizer)."""
    builders = {
        "mixed": lambda rng: _mixed(shape, encode, rng, num_prompts or shape.num_mixed),
        "decode": lambda rng: _decode(shape, encode, rng, num_prompts or shape.num_decode),
        "prefill": lambda rng: _prefill(shape, encode, rng, num_prompts or shape.num_prefill),
        "burst": lambda rng: _burst(shape, rng, num_prompts or shape.num_burst),
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


def _burst(shape, rng, num_prompts) -> GenerationWorkload:
    return GenerationWorkload(
        "burst",
        f"{num_prompts} prompts of {shape.burst_input_len} random token ids, "
        f"{shape.burst_output_len} tokens each",
        random_token_prompts(rng, num_prompts, shape.burst_input_len),
        [shape.burst_output_len] * num_prompts,
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


# ---- the peers -------------------------------------------------------------------------------


class OfflinePeer(Protocol):
    """What `compare` needs of a peer: `name` as on the command line, `column` as in table
    headers, `version`, and `label` (what it runs, for headings). `run` returns (seconds, output
    token ids per prompt in prompt order, each exactly its `max_tokens` long), timed around the
    generation alone; `describe` gives the result JSON's record of it ("label", "column",
    "version", and an optional "note" printed under its table)."""

    name: str
    column: str
    version: str

    @property
    def label(self) -> str: ...

    def warm_up(self, workload: GenerationWorkload) -> None: ...

    def run(self, workload: GenerationWorkload) -> tuple[float, list[list[int]]]: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


class TransformersBaseline:
    """A transformers model with its tokenizer, generating greedy batches of `batch_size`
    prompts (None: all prompts of a workload) without eos stops."""

    name = "transformers"
    column = "transformers"

    def __init__(
        self, folder: Path, device: str, dtype: torch.dtype, batch_size: int | None = None
    ) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.version = transformers.__version__
        self.folder = folder
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        self.model = model.to(self.device).eval()
        # ignore_eos: a GenerationConfig passed to generate() falls back to the model's
        # eos_token_id when it has none, so the model's own must go.
        self.model.generation_config.eos_token_id = None
        self.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0

    @property
    def label(self) -> str:
        return "transformers `generate`"

    def batch_size_for(self, workload: GenerationWorkload) -> int:
        return self.batch_size or workload.num_prompts

    def warm_up(self, workload: GenerationWorkload) -> None:
        self.run(workload)

    def run(self, workload: GenerationWorkload) -> tuple[float, list[list[int]]]:
        """(seconds, output token ids per prompt): batches in order, each to its longest."""
        batch_size = self.batch_size_for(workload)
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

    def describe(self) -> dict:
        return {
            "label": self.label,
            "column": self.column,
            "version": self.version,
            "model_folder": str(self.folder),
            "batch_size": self.batch_size or "all prompts of a workload",
        }

    def close(self) -> None:
        """Nothing: the model lives in this process."""


def load_encoder(folder: Path):
    """`encode(text) -> token ids` with the tokenizer of the HF folder (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def start_peers(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    hf_folder: Path,
    dtype_name: str,
    num_threads: int,
    workloads: list[GenerationWorkload],
    warm_up_workload: GenerationWorkload,
    work_dir: Path,
) -> list[OfflinePeer]:
    """The peers of `args.peers`, loaded, in order; each closes when `stack` does."""
    peers: list[OfflinePeer] = []
    for name in args.peers:
        if name == "transformers":
            dtype = getattr(torch, dtype_name)
            peer = TransformersBaseline(hf_folder, args.device, dtype, args.hf_batch_size)
        elif name == "vllm":
            from benchmarks.peers.vllm import VllmOfflinePeer

            peer = VllmOfflinePeer(
                args.peer_python, hf_folder, dtype_name, num_threads, workloads,
                warm_up_workload, work_dir, seed=args.seed,
            )  # fmt: skip
        else:
            from benchmarks.peers.llama_server import LlamaServerPeer

            num_slots = max(workload.num_prompts for workload in workloads)
            peer = LlamaServerPeer(
                args.llama_server, gguf_path(args.model), num_threads, num_slots, work_dir
            )
        stack.callback(peer.close)
        peers.append(peer)
    return peers


def gguf_path(model: str | None) -> Path:
    """The GGUF file of the engine's model (llama-server runs nothing else)."""
    from core_engine.common.model_files import GGUF_SUFFIX, resolve_model_path

    path = resolve_model_path(model)
    if path.suffix != GGUF_SUFFIX:
        raise ValueError(f"--peer llama-server needs a {GGUF_SUFFIX} model; --model {model} is not")
    return path


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
    peers: list[OfflinePeer],
    workload: GenerationWorkload,
    device: str,
    repeats: int = 1,
) -> list[dict]:
    """Runs the engine then each peer in turn, `repeats` times; one row per peer, holding the
    (engine, peer) pair of one repeat whose ratio is the median."""
    engine_times: list[float] = []
    peer_times: dict[str, list[float]] = {peer.name: [] for peer in peers}
    peer_tokens: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        # A repeat must not find the previous one's prompts in the prefix cache.
        if not llm.reset_prefix_cache():
            raise RuntimeError("the engine refused to reset its prefix cache between repeats")
        engine_s, engine_tokens = run_engine(llm, workload)
        _synchronize(device)
        engine_times.append(engine_s)
        for peer in peers:
            peer_s, peer_tokens[peer.name] = peer.run(workload)
            _synchronize(device)
            peer_times[peer.name].append(peer_s)
    rows = []
    for peer in peers:
        pairs = list(zip(engine_times, peer_times[peer.name], strict=True))
        row = comparison_row(workload, peer.name, pairs, engine_tokens, peer_tokens[peer.name])
        if isinstance(peer, TransformersBaseline):
            engine_passes, peer_passes = token_passes(workload, peer.batch_size_for(workload))
            row["engine_token_passes"] = engine_passes
            row["peer_token_passes"] = peer_passes
            row["work_ratio"] = peer_passes / engine_passes
        print(
            f"{workload.name}: engine {row['engine_output_tokens_per_s']:.1f} tok/s, "
            f"{peer.column} {row['peer_output_tokens_per_s']:.1f} tok/s, ratio "
            f"{row['ratio']:.2f}x ({row['num_requests_first_tokens_agree']}/"
            f"{workload.num_prompts} agree on the first {NUM_COMPARED_TOKENS} tokens; "
            f"pairs: {', '.join(f'{x:.2f}x' for x in row['pair_ratios'])})"
        )
        rows.append(row)
    return rows


def comparison_row(
    workload: GenerationWorkload,
    peer_name: str,
    pairs: list[tuple[float, float]],
    engine_tokens: list[list[int]],
    peer_tokens: list[list[int]],
) -> dict:
    """One workload against one peer: the median pair's throughputs and their ratio (engine /
    peer tokens/s), every pair's ratio, and how many requests agree on the first tokens."""
    engine_s, peer_s = median_pair(pairs)
    num_tokens = workload.num_output_tokens
    return {
        "workload": workload.name,
        "description": workload.description,
        "num_prompts": workload.num_prompts,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": num_tokens,
        "peer": peer_name,
        "engine_s": engine_s,
        "peer_s": peer_s,
        "engine_output_tokens_per_s": num_tokens / engine_s,
        "peer_output_tokens_per_s": num_tokens / peer_s,
        "ratio": peer_s / engine_s,
        "pair_ratios": [peer / engine for engine, peer in pairs],
        "num_requests_first_tokens_agree": count_agreeing(engine_tokens, peer_tokens),
    }


def count_agreeing(
    engine_tokens: list[list[int]],
    peer_tokens: list[list[int]],
    num_tokens: int = NUM_COMPARED_TOKENS,
) -> int:
    """Requests whose first `num_tokens` output tokens are the same on both sides."""
    return sum(
        e[:num_tokens] == p[:num_tokens] for e, p in zip(engine_tokens, peer_tokens, strict=True)
    )


def median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The (engine_s, peer_s) pair with the median ratio (the lower one of two middles)."""
    ordered = sorted(pairs, key=lambda pair: pair[1] / pair[0])
    return ordered[(len(ordered) - 1) // 2]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def set_num_threads(num_threads: int | None) -> int:
    """Gives this process (transformers) and the engine's workers (through OMP_NUM_THREADS,
    which they inherit) `num_threads` torch threads, by default one per usable core as the
    engine itself picks; returns the number."""
    num_threads = num_threads or default_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    return num_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                        help="both sides' dtype (default: the engine's default for the device)")  # fmt: skip
    parser.add_argument("--peer-dtype", default=None, choices=DTYPE_NAMES,
                        help="the peers' dtype, where it differs from the engine's (e.g. vLLM in "
                        "bfloat16 beside the engine's float32 default on a CPU without native "
                        "bf16)")  # fmt: skip
    parser.add_argument("--model", default=None, help="engine model (default: SmolLM2 GGUF)")
    parser.add_argument("--hf-model", type=Path, default=None,
                        help="the same weights as an HF folder, for transformers and vLLM")  # fmt: skip
    parser.add_argument("--peer", "--peers", dest="peers", nargs="+", default=["transformers"],
                        choices=PEER_NAMES, help="what to compare with (default: transformers)")  # fmt: skip
    parser.add_argument(
        "--peer-python",
        default=None,
        help="the Python of vLLM's virtual environment (default: $VLLM_PYTHON or "
        "/work/vllm-venv/bin/python)",
    )
    parser.add_argument("--llama-server", default=None,
                        help="llama-server program (default: the one on PATH)")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
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
        default=None,
        help="CPU threads, the same for every side (default: one per usable core, the "
        "engine's default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="engine/peer pairs per workload, the median ratio reported (default: 3, "
        "1 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.peers = list(dict.fromkeys(args.peers))  # in order, each once
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.peer_dtype is not None and "llama-server" in args.peers:
        parser.error(
            f"--peer-dtype {args.peer_dtype} does not apply to llama-server, which runs the "
            "GGUF's own weight types: measure it in a run without --peer-dtype"
        )
    if "vllm" in args.peers:
        from benchmarks.peers.vllm import default_peer_python, vllm_version

        args.peer_python = args.peer_python or default_peer_python()
        try:
            vllm_version(args.peer_python)
        except ValueError as exc:
            parser.error(str(exc))
    if "llama-server" in args.peers:
        from benchmarks.peers.llama_server import find_llama_server

        try:
            args.llama_server = find_llama_server(args.llama_server)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def results_file_name(device: str, peers: list[str], peer_dtype: str | None = None) -> str:
    """The results' base name: `offline` against transformers alone on cpu (a table of docs/benchmarks.md);
    the device, the peers and a peer dtype of their own otherwise, so that no comparison
    overwrites another."""
    name = "offline" if device == "cpu" else f"offline_{device}"
    if peers != ["transformers"]:
        name += "_" + "_".join(peer.replace("-", "_") for peer in peers)
    if peer_dtype is not None:
        name += f"_peer_{peer_dtype}"
    return name


def main() -> None:
    args = parse_args()
    num_threads = set_num_threads(args.threads)
    dtype_name = args.dtype or engine_default_dtype(args.device)
    peer_dtype_name = args.peer_dtype if args.peer_dtype != dtype_name else None
    num_prompts = args.num_prompts or (GPU_NUM_PROMPTS if args.device == "cuda" else None)
    machine = machine_info()
    hf_folder = args.hf_model or default_hf_folder(args.model)
    encode = load_encoder(hf_folder)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    workloads = build_workloads(shape, encode, args.seed, args.workloads, num_prompts)
    # First calls allocate and compile; no side is timed on them.
    warm_up = GenerationWorkload("warm-up", "", [encode("Hello there, how are you today?")] * 2,
                                 [4, 4])  # fmt: skip
    engine_args = {"max_num_seqs": args.max_num_seqs}
    if args.device == "cuda":
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-offline-") as work_dir,
        contextlib.ExitStack() as stack,
    ):
        peers = start_peers(
            args,
            stack,
            hf_folder,
            peer_dtype_name or dtype_name,
            num_threads,
            workloads,
            warm_up,
            Path(work_dir),
        )
        llm = stack.enter_context(
            LLM(args.model, device=args.device, dtype=dtype_name, **engine_args)
        )
        run_engine(llm, warm_up)
        for peer in peers:
            peer.warm_up(warm_up)
        for workload in workloads:
            rows += compare(llm, peers, workload, args.device, repeats=args.repeats)
            gc.collect()
        peer_records = {peer.name: peer.describe() for peer in peers}
    mixed_ratios = {row["peer"]: row["ratio"] for row in rows if row["workload"] == "mixed"}
    mixed_speedup = mixed_ratios.get("transformers")
    result = {
        "benchmark": "offline",
        "quick": args.quick,
        "machine": machine,
        "device": args.device,
        "dtype": dtype_name,
        "peer_dtype": peer_dtype_name or dtype_name,
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 GGUF (default)",
        "hf_model_folder": str(hf_folder),
        "engine_args": engine_args,
        "num_threads": num_threads,
        "torch_num_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "seed": args.seed,
        "peers": peer_records,
        "rows": rows,
        "mixed_ratios": mixed_ratios,
        "target_speedup_mixed": TARGET_SPEEDUP,
        "mixed_speedup": mixed_speedup,
        "meets_target": bool(mixed_speedup and mixed_speedup >= TARGET_SPEEDUP),
    }
    name = results_file_name(args.device, args.peers, peer_dtype_name)
    write_results(result, render_markdown(result), args.output_dir, result_name(name, args.quick))


def render_markdown(result: dict) -> str:
    """One table per peer (transformers' with the token positions each side runs), the pairs
    behind each median, and the mixed workload's ratio against the transformers target."""
    sections = [_peer_section(result, name, record) for name, record in result["peers"].items()]
    text = "\n".join(sections)
    if result["mixed_speedup"] is not None:
        text += (
            f"\nMixed workload: engine / transformers = **{result['mixed_speedup']:.2f}x** "
            f"(target >= {result['target_speedup_mixed']:.0f}x, "
            f"{'met' if result['meets_target'] else 'missed'}).\n"
        )
    return text


def _peer_section(result: dict, peer_name: str, record: dict) -> str:
    column = record["column"]
    peer_rows = [row for row in result["rows"] if row["peer"] == peer_name]
    with_passes = all("work_ratio" in row for row in peer_rows)
    header = ["workload", "engine output tok/s", f"{column} output tok/s", f"engine / {column}"]
    if with_passes:
        header.append(f"token positions {column} / engine")
    header.append(f"same first {NUM_COMPARED_TOKENS} tokens")
    table_rows = []
    for row in peer_rows:
        cells = [
            f"{row['workload']} ({row['description']})",
            f"{row['engine_output_tokens_per_s']:.1f}",
            f"{row['peer_output_tokens_per_s']:.1f}",
            f"**{row['ratio']:.2f}x**",
        ]
        if with_passes:
            cells.append(f"{row['work_ratio']:.2f}x")
        cells.append(f"{row['num_requests_first_tokens_agree']}/{row['num_prompts']}")
        table_rows.append(cells)
    threads = result.get("num_threads")
    dtypes = result["dtype"]
    if result.get("peer_dtype", dtypes) != dtypes:
        dtypes = f"engine {dtypes}, {column} {result['peer_dtype']}"
    conditions = f"{result['device']}, {dtypes}" + (f", {threads} threads" if threads else "")
    text = (
        f"### Offline throughput: `LLM.generate` vs {record['label']} ({conditions})\n\n"
        f"{markdown_table(header, table_rows)}\n"
    )
    if with_passes:
        text += (
            f"\nToken positions: what each side runs through the model ({column} pads every "
            "prompt to its batch's longest and runs every row to the batch's longest "
            "max_tokens); their ratio is the speedup the engine gets from doing less work "
            "alone, at equal cost per position.\n"
        )
    if record.get("note"):
        text += f"\n{record['note']}\n"
    repeats = result.get("repeats", 1)
    if repeats > 1:
        pairs = "; ".join(
            f"{row['workload']} " + ", ".join(f"{x:.2f}x" for x in row["pair_ratios"])
            for row in peer_rows
        )
        text += (
            f"\nEach workload ran {repeats} engine/{column} pairs; the table shows the pair "
            f"with the median ratio (all pairs: {pairs}).\n"
        )
    return text


if __name__ == "__main__":
    main()
