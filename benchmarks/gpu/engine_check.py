"""The engine end to end on random weights of a real model's shapes (no weights travel).

    python -m benchmarks.gpu.engine_check --model smollm2-135m [--device cuda] [--out FILE.json]

1. Writes an HF folder with random weights of the named model's shapes (config.json,
   model.safetensors in bf16 as checkpoints ship, a word-level tokenizer covering the whole
   vocabulary), made on the device in seconds.
2. Greedy parity: the same prompts, long enough for chunked prefill and batches that mix
   prefill chunks with decodes, in float32 through the engine, its attention on the device's
   kernels and on the torch reference backend; every token must be equal.
   The kernels run twice, with decode steps replayed as CUDA graphs (the default) and with
   `enforce_eager`: their tokens must be equal too.
3. Throughput: `LLM.generate` (the engine processes a user starts) on 256 prompts of 128
   random token ids, 128 greedy tokens each (ignore_eos), in the device's default dtype,
   after a warm-up workload; with the defaults, with `async_scheduling` (the core plans the
   next step while the device runs this one), whose greedy tokens must be the same, and with
   `enforce_eager` (no CUDA graphs; its tokens' agreement is reported: bf16 matmuls over
   another batch shape may round differently).

Writes the figures as JSON (`--out`) and exits 1 when the tokens differ. The `tiny` shape runs
the same steps in seconds on a CPU (the GPU kit's dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from core_engine.core.in_process_engine import InProcessEngine
from core_engine.kernels import attention, torch_reference
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.local_executor import LocalExecutor

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# config.json of each shape: the real models' sizes, fields as their checkpoints have them.
MODEL_SHAPES = {
    "smollm2-135m": {
        **_LLAMA_COMMON,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
    },
    "llama-3.2-1b": {
        **_LLAMA_COMMON,
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3-0.6b": {
        **_LLAMA_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
    },
    "tiny": {
        **_LLAMA_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    },
}
# Standard deviation of the random matrices (transformers' Llama initializer range): logits
# spread enough that float32 rounding does not decide a greedy token.
WEIGHT_STD = 0.02
PARITY_NUM_BLOCKS = 1024
NUM_SPECIAL_IDS = 3  # 0 unk, 1 bos, 2 eos: never drawn into a prompt


@dataclass(frozen=True, slots=True)
class Workloads:
    """The parity and throughput workloads of one run (smaller for `tiny`)."""

    parity_prompt_lens: tuple[int, ...]
    parity_max_tokens: int
    parity_batched_tokens: int  # small, so prompts are chunked and mixed with decodes
    num_prompts: int
    prompt_len: int
    max_tokens: int

    @property
    def max_model_len(self) -> int:
        return max(max(self.parity_prompt_lens) + self.parity_max_tokens, 2 * self.prompt_len)


FULL_WORKLOADS = Workloads((1, 7, 40, 150, 300, 700), 32, 256, 256, 128, 128)
TINY_WORKLOADS = Workloads((1, 7, 40, 90), 8, 64, 16, 32, 16)


def write_random_model(folder: Path, shape: dict, device: torch.device, seed: int = 0) -> Path:
    """config.json, model.safetensors (bf16, HF Llama names) and tokenizer files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**shape, "torch_dtype": "bfloat16"}))
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {
        name: _random_weight(name, size, generator, device).cpu()
        for name, size in llama_weight_shapes(shape).items()
    }
    save_file(tensors, str(folder / "model.safetensors"))
    write_word_tokenizer(folder, shape["vocab_size"])
    return folder


def llama_weight_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q_size = shape["num_attention_heads"] * head_dim
    kv_size = shape["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (shape["vocab_size"], hidden)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            **(
                {
                    f"{layer}.self_attn.q_norm.weight": (head_dim,),
                    f"{layer}.self_attn.k_norm.weight": (head_dim,),
                }
                if shape.get("model_type") == "qwen3"
                else {}
            ),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not shape.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (shape["vocab_size"], hidden)
    return shapes


def _random_weight(name: str, size, generator, device) -> torch.Tensor:
    noise = torch.randn(size, generator=generator, device=device)
    weight = 1.0 + 0.1 * noise if "norm" in name else WEIGHT_STD * noise
    return weight.to(torch.bfloat16)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """One word per id ("t0" .. "t{vocab-1}"), so every id the model can emit decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "t1", "eos_token": "t2", "unk_token": "t0"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def random_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(NUM_SPECIAL_IDS, vocab_size, (length,), generator=generator).tolist()
        for length in lengths
    ]


@contextlib.contextmanager
def reference_attention() -> Iterator[list[int]]:
    """Attention on the torch reference backend, whatever the device (this process only);
    yields a one-element list counting the layers' calls that took it."""
    select_backend = attention.select_backend
    calls = [0]

    def reference(device: torch.device):
        calls[0] += 1
        return torch_reference

    attention.select_backend = reference
    try:
        yield calls
    finally:
        attention.select_backend = select_backend


def greedy_parity(folder: Path, shape: dict, device: str, workloads: Workloads) -> dict:
    """Float32 greedy tokens with the kernels (decode steps as CUDA graphs, the default), with
    the kernels run eagerly (`enforce_eager`), and with the reference backend (eagerly: it reads
    on the host), compared: "equal" kernels vs reference, "eager_equal" graphs vs eager."""
    prompts = random_prompts(workloads.parity_prompt_lens, shape["vocab_size"], seed=1)
    params = SamplingParams(
        temperature=0.0, max_tokens=workloads.parity_max_tokens, ignore_eos=True
    )

    def run(enforce_eager: bool = False) -> list[list[int]]:
        config = EngineConfig(
            model=str(folder),
            device=device,
            dtype="float32",
            max_model_len=workloads.max_model_len,
            max_num_batched_tokens=workloads.parity_batched_tokens,
            # The prompts' blocks and then some: no memory profiling, and the engines in turn
            # in this process never hold more than a sliver of the device.
            num_gpu_blocks_override=PARITY_NUM_BLOCKS,
            enforce_eager=enforce_eager,
        )
        engine = InProcessEngine(config, LocalExecutor(config))
        token_ids = [r.token_ids for r in engine.generate(prompts, params).results]
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        return token_ids

    start = time.perf_counter()
    with_kernels = run()
    eager_kernels = run(enforce_eager=True)
    with reference_attention() as reference_calls:
        with_reference = run(enforce_eager=True)
    if not reference_calls[0]:
        raise RuntimeError("the reference run never reached the torch reference backend")
    per_prompt = [
        {
            "prompt_len": len(prompt),
            "num_tokens": len(kernel_tokens),
            "equal_prefix": _common_prefix(kernel_tokens, reference_tokens),
        }
        for prompt, kernel_tokens, reference_tokens in zip(
            prompts, with_kernels, with_reference, strict=True
        )
    ]
    return {
        "dtype": "float32",
        "max_num_batched_tokens": workloads.parity_batched_tokens,
        "equal": with_kernels == with_reference
        and all(len(t) == workloads.parity_max_tokens for t in with_kernels),
        "eager_equal": with_kernels == eager_kernels,
        "prompts": per_prompt,
        "elapsed_s": time.perf_counter() - start,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def offline_throughput(
    folder: Path, shape: dict, device: str, workloads: Workloads, **engine_args
) -> tuple[dict, list[list[int]]]:
    """Output tokens per second of `LLM.generate` over the workload, after a warm-up, and the
    tokens of every prompt."""
    from core_engine.frontend import LLM

    prompts = random_prompts(
        [workloads.prompt_len] * workloads.num_prompts, shape["vocab_size"], seed=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=workloads.max_tokens, ignore_eos=True)
    with LLM(
        model=str(folder),
        device=device,
        max_num_seqs=workloads.num_prompts,
        max_model_len=workloads.max_model_len,
        **engine_args,
    ) as llm:
        warm_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[:8], warm_up, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start
    num_output = sum(len(output.outputs[0].token_ids) for output in outputs)
    expected = workloads.num_prompts * workloads.max_tokens
    if num_output != expected:
        raise RuntimeError(f"the engine returned {num_output} tokens, asked {expected}")
    figures = {
        "num_prompts": workloads.num_prompts,
        "prompt_len": workloads.prompt_len,
        "max_tokens": workloads.max_tokens,
        "elapsed_s": elapsed_s,
        "output_tok_s": num_output / elapsed_s,
        "total_tok_s": (num_output + workloads.num_prompts * workloads.prompt_len) / elapsed_s,
    }
    return figures, [output.outputs[0].token_ids for output in outputs]


def throughput_variants(folder: Path, shape: dict, device: str, workloads: Workloads) -> dict:
    """`offline_throughput` with the defaults (on a GPU: decode steps as CUDA graphs), then
    with async scheduling under "async_scheduling" and with every step eager under
    "enforce_eager", each with whether every prompt's tokens were the same as the first run's
    ("async_equal", "eager_equal")."""
    figures, tokens = offline_throughput(folder, shape, device, workloads)
    for name, equal_key in (("async_scheduling", "async_equal"), ("enforce_eager", "eager_equal")):
        figures[name], variant_tokens = offline_throughput(
            folder, shape, device, workloads, **{name: True}
        )
        figures[equal_key] = variant_tokens == tokens
    return figures


def check_parser(doc: str, default_model: str) -> argparse.ArgumentParser:
    """The arguments of every check on random weights: --model (a shape), --device, --out."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=default_model)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, help="where the JSON figures go")
    return parser


def cuda_missing(device: str) -> bool:
    """Whether `device` is cuda on a machine without it (said on stderr)."""
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA device", file=sys.stderr)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = check_parser(__doc__, "smollm2-135m")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    shape = MODEL_SHAPES[args.model]
    workloads = TINY_WORKLOADS if args.model == "tiny" else FULL_WORKLOADS
    result: dict = {"model": args.model, "device": args.device, "config": shape}
    with tempfile.TemporaryDirectory(prefix=f"random-{args.model}-") as tmp:
        start = time.perf_counter()
        folder = write_random_model(Path(tmp), shape, torch.device(args.device))
        result["write_weights_s"] = time.perf_counter() - start
        result["parity"] = greedy_parity(folder, shape, args.device, workloads)
        print(f"greedy parity (float32, kernels vs torch reference): {result['parity']}")
        if not args.skip_throughput:
            result["throughput"] = throughput_variants(folder, shape, args.device, workloads)
            print(f"offline throughput: {result['throughput']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    async_equal = result.get("throughput", {}).get("async_equal", True)
    parity = result["parity"]
    return 0 if parity["equal"] and parity["eager_equal"] and async_equal else 1


if __name__ == "__main__":
    sys.exit(main())
