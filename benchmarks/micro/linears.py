"""The CPU worker's linears, several ways, on the default model's shapes, in one dtype (the
engine's default on this CPU unless --dtype):
- bfloat16: the project's bf16 kernel (`kernels/cpu/bf16_matmul.c`, what a bf16 model runs
  where the CPU has AVX512_BF16), oneDNN's bf16 linear on pre-packed weights (where oneDNN
  runs bf16), and torch's weight-only int8 matmul (`aten._weight_int8pack_mm`, per-channel
  scales: the quantized alternative);
- float32: the project's float32 kernel (`kernels/cpu/f32_matmul.c`, what a float32 model runs
  on an AVX2 CPU without AVX-512), oneDNN's float32 linear on pre-packed weights (what it runs
  elsewhere) and plain `F.linear` (MKL, what a model without packing runs);
- with `--quantization gguf`: the GGUF-block kernel (`kernels/cpu/gguf_matmul.c`) on the
  weights quantized to Q4_1 (the default model file's type), against the float32 kernels on
  the same values dequantized (what the engine runs without --quantization); and the same for
  the LM head (49152 x 576 in Q8_0, the default file's tied embedding), timed on its own.

Each timing runs the linears of all decoder layers in order (qkv, o, gate_up, down, 30 times
for SmolLM2-135M), so the weights stream from memory as in a real step rather than sitting in
cache. Reported per batch size (rows): milliseconds per pass and each way's speed relative to
the first way (the engine's), measured in the same run, alternating.

    python -m benchmarks.micro.linears [--quick] [--dtype float32] [--rows 1 8 28 64 256]
    python -m benchmarks.micro.linears --quantization gguf
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.common import (
    RESULTS_DIR,
    default_num_threads,
    engine_default_dtype,
    machine_info,
    markdown_table,
    result_name,
    write_results,
)
from core_engine.common.dtypes import torch_dtype
from core_engine.kernels.cpu.bf16_matmul import Bf16MatmulWeight
from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight
from core_engine.kernels.cpu.gguf_matmul import GGUF_MATMUL_TYPES, GgufMatmulWeight, GgufSegment
from core_engine.worker.model_executor.cpu_linear import pack_weight, packed_linear

# (out_features, in_features) of one SmolLM2-135M decoder layer: qkv, o, gate_up, down
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30
LM_HEAD_SHAPE = (49152, 576)  # SmolLM2's vocabulary x hidden (tied to the embedding)


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 weight and its bf16 scales."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    quantized = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scale.to(torch.bfloat16)


def build_ways(num_layers: int, dtype: torch.dtype, quantization: str | None = None) -> dict:
    """name -> (list of per-linear callables x -> y) for every way available on this CPU, the
    engine's own way first."""
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(shape, generator=generator).to(dtype)
        for _ in range(num_layers)
        for shape in LAYER_SHAPES
    ]
    if quantization == "gguf":
        return gguf_ways(weights, "Q4_1")
    return bf16_ways(weights) if dtype == torch.bfloat16 else float32_ways(weights)


def lm_head_ways() -> dict:
    """The GGUF-block kernel on a Q8_0 LM head (as the default file ships it), then the float32
    ways on its dequantized values."""
    generator = torch.Generator().manual_seed(1)
    return gguf_ways([torch.randn(LM_HEAD_SHAPE, generator=generator)], "Q8_0")


def gguf_ways(weights: list[torch.Tensor], type_name: str) -> dict:
    """The GGUF-block kernel on blocks of `type_name`, then the float32 ways on their
    dequantized values."""
    import gguf

    quant_type = gguf.GGMLQuantizationType[type_name]
    blocks = [gguf.quants.quantize(w.float().numpy() * 0.02, quant_type) for w in weights]
    kernel = [
        GgufMatmulWeight.of([GgufSegment(GGUF_MATMUL_TYPES[type_name], torch.from_numpy(b))])
        for b in blocks
    ]
    ways = {f"GGUF {type_name} kernel": [lambda x, k=k: k.matmul(x) for k in kernel]}
    dequantized = [torch.from_numpy(gguf.quants.dequantize(b, quant_type)).float() for b in blocks]
    return ways | float32_ways(dequantized)


def bf16_ways(weights: list[torch.Tensor]) -> dict:
    ways = {}
    kernel = [Bf16MatmulWeight.pack(w) for w in weights]
    if all(k is not None for k in kernel):
        ways["bf16 kernel"] = [lambda x, k=k: k.matmul(x) for k in kernel]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = [pack_weight(w) for w in weights]
        ways["oneDNN bf16"] = [lambda x, p=p: packed_linear(x, p, None) for p in packed]
    quantized = [int8_weight(w) for w in weights]
    ways["torch int8 weight-only"] = [
        lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in quantized
    ]
    return ways


def float32_ways(weights: list[torch.Tensor]) -> dict:
    ways = {}
    kernel = [F32MatmulWeight.pack(w) for w in weights]
    if all(k is not None for k in kernel):
        ways["f32 kernel"] = [lambda x, k=k: k.matmul(x) for k in kernel]
    packed = [pack_weight(w) for w in weights]
    ways["oneDNN float32"] = [lambda x, p=p: packed_linear(x, p, None) for p in packed]
    ways["F.linear float32"] = [lambda x, w=w: F.linear(x, w) for w in weights]
    return ways


def time_pass(
    linears: list, in_features: list[int], inputs: dict[int, torch.Tensor], repeats: int
) -> float:
    """Milliseconds per pass over every linear, linear i on inputs[in_features[i]] (median of
    `repeats` passes)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, linear in zip(in_features, linears, strict=True):
            linear(inputs[k])
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(
    rows_list: list[int], ways: dict, shapes: list[tuple[int, int]], repeats: int, dtype
) -> list[dict]:
    """Per batch size, ms per pass of each way over linears of `shapes`, alternating ways."""
    in_features = [k for _, k in shapes]
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k).to(dtype) for k in set(in_features)}
        for linears in ways.values():
            time_pass(linears, in_features, inputs, 1)  # warm-up
        ms = {
            name: time_pass(linears, in_features, inputs, repeats) for name, linears in ways.items()
        }
        results.append({"rows": rows, "ms_per_pass": ms})
        print(f"rows {rows}: " + ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items()))
    return results


def render_markdown(result: dict) -> str:
    text = (
        f"### Linears of {result['num_layers']} SmolLM2-135M layers on CPU "
        f"({result['dtype']}{', GGUF blocks' if result.get('quantization') else ''}, "
        f"{result['threads']} threads, weights streamed from memory)\n\n"
        + ratio_table(result["rows"])
    )
    if result.get("lm_head_rows"):
        text += (
            f"\n\n### The LM head ({LM_HEAD_SHAPE[0]} x {LM_HEAD_SHAPE[1]}, Q8_0 as the default "
            "file ships it)\n\n" + ratio_table(result["lm_head_rows"])
        )
    return text + (
        "\n\nTime ratios above 1 are slower than the first way (the engine's). Median of "
        f"{result['repeats']} passes per cell.\n"
    )


def ratio_table(rows: list[dict]) -> str:
    names = list(rows[0]["ms_per_pass"])
    baseline = names[0]
    header = ["rows", *(f"{name} ms" for name in names), *(
        f"{name} / {baseline}" for name in names if name != baseline
    )]  # fmt: skip
    table_rows = []
    for row in rows:
        ms = row["ms_per_pass"]
        ratios = [f"{ms[name] / ms[baseline]:.2f}x" for name in names if name != baseline]
        table_rows.append([row["rows"], *(f"{ms[name]:.2f}" for name in names), *ratios])
    return markdown_table(header, table_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=0, help="default: every usable core")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: the engine's"
    )
    parser.add_argument("--quantization", choices=["gguf"], default=None,
                        help="gguf: the GGUF-block kernel on Q4_1 weights and a Q8_0 LM head, "
                        "against float32")  # fmt: skip
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    threads = args.threads or default_num_threads()
    torch.set_num_threads(threads)
    rows_list = args.rows or ([1, 28] if args.quick else [1, 8, 28, 64, 256])
    num_layers, repeats = (2, 3) if args.quick else (NUM_LAYERS, 7)
    dtype_name = "float32" if args.quantization else args.dtype or engine_default_dtype("cpu")
    result = {
        "benchmark": "linears",
        "quick": args.quick,
        "machine": machine_info(),
        "threads": threads,
        "dtype": dtype_name,
        "quantization": args.quantization,
        "num_layers": num_layers,
        "repeats": repeats,
    }
    dtype = torch_dtype(dtype_name)
    ways = build_ways(num_layers, dtype, args.quantization)
    result["rows"] = measure(rows_list, ways, list(LAYER_SHAPES) * num_layers, repeats, dtype)
    if args.quantization == "gguf":
        del ways  # the layers' weights go before the LM head's (113 MB a float32 way) arrive
        result["lm_head_rows"] = measure(rows_list, lm_head_ways(), [LM_HEAD_SHAPE], repeats, dtype)
    name = "gguf_linears" if args.quantization else "linears"
    write_results(result, render_markdown(result), args.output_dir, result_name(name, args.quick))


if __name__ == "__main__":
    main()
