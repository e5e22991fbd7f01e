"""Benchmark the CuPy paged-attention kernels against torch SDPA on one GPU.

    python -m benchmarks.micro.attention [--quick | --kit] [--dtype bfloat16] [--repeats 20] [--out DIR]

Decode: µs, GB/s, % of the device's spec bandwidth and % of the measured device-copy ceiling,
with bytes = sum(ctx) * 2 * H_kv * D * dtype_bytes + query and output bytes; the baseline is
torch SDPA on contiguous KV, timed with and without gathering that KV from the paged cache.
Prefill: TFLOP/s (causal FLOPs, 2 * B * H * L^2 * D) against SDPA on contiguous tensors of the
same shapes, on its FlashAttention backend where torch has it for the shape (the backend SDPA
ran is recorded). `--kit` runs the GPU run kit's shapes (benchmarks/gpu/check.py): decode at batch
64, context 4k, head_dim 128, GQA groups 1, 4 and 8; prefill of 1k and 4k-token prompts. Every measurement flushes L2 first, replays a CUDA graph (eager if capture fails),
times with CUDA events and keeps the median; the KV pool is much larger than L2 and its blocks
are scattered. Results go to benchmarks/results/attention_<device>[_quick].{json,md}.
Needs only torch and CuPy on a CUDA machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from core_engine.kernels import AttentionMetadata
from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.kernels.cuda import launch_config as lc

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BLOCK_SIZE = 16
POOL_BYTES = 4 << 30  # KV pool size: far above any L2 (50 MB on H100)
FLUSH_BYTES = 256 << 20
MAX_TOKENS_IN_BATCH = 1 << 21
# Spec HBM bandwidth in GB/s, matched against the device name (first match wins).
SPEC_BANDWIDTH_GBPS = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
]


@dataclass(frozen=True, slots=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_lens: tuple[int, ...]
    label: str

    @property
    def batch(self) -> int:
        return len(self.context_lens)


@dataclass(slots=True)
class DecodeResult:
    label: str
    batch: int
    mean_context: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_splits: int
    kernel_us: float
    gbps: float
    pct_spec: float | None
    pct_copy_ceiling: float
    sdpa_us: float | None
    sdpa_gather_us: float | None
    speedup_vs_sdpa: float | None
    speedup_vs_sdpa_gather: float | None


@dataclass(slots=True)
class PrefillResult:
    label: str
    batch: int
    query_len: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kernel_us: float
    kernel_tflops: float
    sdpa_us: float | None
    sdpa_tflops: float | None
    ratio_vs_sdpa: float | None
    sdpa_backend: str | None = None  # "flash", "flash (K/V repeated per head)" or "default"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not cuda_backend.is_available():
        print("bench_attention needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    timer = Timer(device, args.repeats)
    name = torch.cuda.get_device_name(device)
    copy_variants = timer.copy_bandwidths_gbps()
    copy_gbps = max(copy_variants.values())
    spec_gbps = spec_bandwidth_gbps(name)
    print(f"{name}: copy ceiling {copy_gbps:.0f} GB/s ({copy_variants}), spec {spec_gbps} GB/s")
    decode = [
        bench_decode(shape, dtype, device, timer, copy_gbps, spec_gbps)
        for shape in (kit_decode_shapes() if args.kit else decode_shapes(args.quick))
    ]
    prefill = [
        bench_prefill(*shape, dtype=dtype, device=device, timer=timer)
        for shape in (kit_prefill_shapes() if args.kit else prefill_shapes(args.quick))
    ]
    report = {
        "device": name,
        "dtype": args.dtype,
        "copy_ceiling_gbps": copy_gbps,
        "copy_bandwidths_gbps": copy_variants,
        "spec_bandwidth_gbps": spec_gbps,
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "decode": [asdict(r) for r in decode],
        "prefill": [asdict(r) for r in prefill],
        "targets": check_targets(decode, prefill),
    }
    if args.kit:
        report["decode_variants"] = [
            asdict(v) for v in bench_decode_variants(dtype, device, timer, copy_gbps)
        ]
    write_report(report, Path(args.out), "_kit" if args.kit else "_quick" if args.quick else "")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--quick", action="store_true", help="only the target configurations")
    shapes.add_argument("--kit", action="store_true", help="the GPU run kit's shapes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    return parser.parse_args(argv)


def decode_shapes(quick: bool) -> list[DecodeShape]:
    """The KERNELS.md sweep: batch 1-256, context 512-32k, group 1/4/8, head_dim 64/128."""
    main_targets = [
        DecodeShape(32, 8, 128, (4096,) * 64, "target: b64 ctx4k"),
        DecodeShape(32, 8, 128, (32768,), "target: b1 ctx32k"),
    ]
    if quick:
        return main_targets
    shapes = list(main_targets)
    for batch in (1, 8, 32, 64, 128, 256):
        for ctx in (512, 2048, 4096, 8192, 32768):
            if batch * ctx <= MAX_TOKENS_IN_BATCH:
                shapes.append(DecodeShape(32, 8, 128, (ctx,) * batch, "sweep"))
    for num_heads, num_kv_heads, head_dim in ((8, 8, 128), (64, 8, 128), (32, 8, 64), (8, 8, 64)):
        for batch, ctx in ((1, 8192), (16, 4096), (128, 2048)):
            shapes.append(
                DecodeShape(num_heads, num_kv_heads, head_dim, (ctx,) * batch, "group/head_dim")
            )
    generator = torch.Generator().manual_seed(1)
    for batch, max_ctx in ((16, 8192), (64, 4096), (256, 2048)):
        lens = torch.randint(64, max_ctx + 1, (batch,), generator=generator).tolist()
        shapes.append(DecodeShape(32, 8, 128, tuple(lens), "varlen"))
    return shapes


def prefill_shapes(quick: bool) -> list[tuple[int, int, int, int, int, int, str]]:
    """(batch, query_len, context_len, num_heads, num_kv_heads, head_dim, label)."""
    shapes = [(4, 2048, 2048, 32, 8, 128, "target: prefill")]
    if quick:
        return shapes
    return shapes + [
        (1, 8192, 8192, 32, 8, 128, "prefill"),
        (16, 512, 512, 32, 8, 128, "prefill"),
        (4, 1024, 1024, 32, 8, 64, "prefill"),
        (2, 512, 4096, 32, 8, 128, "chunked prefill over context"),
    ]


KIT_GROUPS = (1, 4, 8)
# The kit's targets: decode at this share of the measured copy bandwidth for these groups
# (group 1 reads the same bytes with a quarter of the math per byte: reported, not a target),
# tensor-core prefill at this speed relative to SDPA's flash kernel.
KIT_BANDWIDTH_TARGET_GROUPS = (4, 8)
KIT_DECODE_PCT_COPY = 85.0
KIT_PREFILL_VS_SDPA = 0.7
KIT_PREFILL_TOKENS = (1024, 4096)
# Tokens per prefill shape of the kit: enough query tiles to fill every SM several times.
KIT_PREFILL_BATCH_TOKENS = 8192


def kit_decode_shapes() -> list[DecodeShape]:
    """Batch 64 at context 4k, head_dim 128, 8 KV heads, GQA groups 1, 4 and 8."""
    return [
        DecodeShape(8 * group, 8, 128, (4096,) * 64, f"kit: b64 ctx4k group {group}")
        for group in KIT_GROUPS
    ]


def kit_prefill_shapes() -> list[tuple[int, int, int, int, int, int, str]]:
    """Whole prompts of 1k and 4k tokens (8k tokens per shape), 32/8 heads, head_dim 128."""
    return [
        (KIT_PREFILL_BATCH_TOKENS // tokens, tokens, tokens, 32, 8, 128, f"kit: prefill {tokens}")
        for tokens in KIT_PREFILL_TOKENS
    ]


class Timer:
    """Median GPU time of a callable: L2 flushed before each run, CUDA graph when possible."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.flush_buffer = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def median_us(self, fn: Callable[[], object], graph: bool = True) -> float:
        """Median µs of `fn` over the repeats, each after an L2 flush; replayed from a CUDA
        graph (eager where capture fails, or with `graph=False`)."""
        runner = self._capture(fn) if graph else self._warm(fn)
        times = []
        for _ in range(self.repeats):
            self.flush_buffer.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            runner()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        return statistics.median(times)

    def _warm(self, fn: Callable[[], object]) -> Callable[[], object]:
        for _ in range(2):
            fn()  # compile kernels, settle the allocator
        torch.cuda.synchronize(self.device)
        return fn

    def _capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm(fn)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return graph.replay
        except RuntimeError as error:
            print(f"  (graph capture failed, timing eagerly: {error})")
            torch.cuda.synchronize(self.device)
            return fn

    def copy_bandwidths_gbps(self) -> dict[str, float]:
        """Device-to-device copy bandwidth (read + write bytes) of a 1 GiB buffer, three ways:
        cudaMemcpy replayed from a graph (a graph's memcpy node may run on a copy engine) and
        eagerly, and an elementwise kernel on the SMs (as the attention kernels read). The
        ceiling is the fastest: the first GPU run measured 2.76 TB/s for the graph's memcpy
        on an H200, below what decode itself read."""
        source = torch.empty(1 << 30, dtype=torch.uint8, device=self.device)
        target = torch.empty_like(source)
        words, target_words = source.view(torch.float32), target.view(torch.float32)
        words.zero_()
        variants = {
            "memcpy graph": self.median_us(lambda: target.copy_(source)),
            "memcpy eager": self.median_us(lambda: target.copy_(source), graph=False),
            "SM kernel": self.median_us(lambda: torch.mul(words, 1.0, out=target_words)),
        }
        return {name: 2 * source.numel() / us / 1e3 for name, us in variants.items()}


def spec_bandwidth_gbps(device_name: str) -> float | None:
    for pattern, gbps in SPEC_BANDWIDTH_GBPS:
        if pattern in device_name:
            return gbps
    return None


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    block_ids: torch.Tensor  # [batch, max_blocks], int64, for the gather baseline


def build_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedBatch:
    """Random q and a random KV pool (>= POOL_BYTES) whose blocks are scattered over the pool."""
    block_bytes = 2 * BLOCK_SIZE * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    blocks_per_req = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    num_blocks = max(sum(blocks_per_req) + 1, POOL_BYTES // block_bytes)
    kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    order = torch.randperm(num_blocks - 1, device=device)[: sum(blocks_per_req)] + 1
    max_blocks = max(blocks_per_req)
    block_ids = torch.zeros(len(context_lens), max_blocks, dtype=torch.int64, device=device)
    offset = 0
    for r, count in enumerate(blocks_per_req):
        block_ids[r, :count] = order[offset : offset + count]
        offset += count
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((query_start_loc[-1],), -1, dtype=torch.int64, device=device),
        block_table=block_ids.to(torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
    )
    query = torch.randn(query_start_loc[-1], num_heads, head_dim, dtype=dtype, device=device)
    return PagedBatch(query, kv_cache, metadata, block_ids)


def gather_kv(batch: PagedBatch, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [B, H_kv, ctx, D] K and V gathered from the pages (uniform context only)."""
    num_blocks = math.ceil(context_len / BLOCK_SIZE)
    ids = batch.block_ids[:, :num_blocks]
    shape = (ids.shape[0], num_blocks * BLOCK_SIZE, *batch.kv_cache.shape[3:])
    keys = batch.kv_cache[0][ids].reshape(shape)[:, :context_len].transpose(1, 2)
    values = batch.kv_cache[1][ids].reshape(shape)[:, :context_len].transpose(1, 2)
    return keys, values


def bench_decode(
    shape: DecodeShape,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    copy_gbps: float,
    spec_gbps: float | None,
) -> DecodeResult:
    torch.cuda.empty_cache()  # the previous shape's pool and graphs are gone; return their memory
    lens = list(shape.context_lens)
    batch = build_paged_batch(
        lens, [1] * shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_dim, dtype, device
    )
    scale = shape.head_dim**-0.5
    out = torch.empty_like(batch.query)
    kernel_us = timer.median_us(
        lambda: cuda_backend.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, scale, out
        )
    )
    element_bytes = torch.finfo(dtype).bits // 8
    kv_bytes = sum(lens) * 2 * shape.num_kv_heads * shape.head_dim * element_bytes
    total_bytes = kv_bytes + 2 * batch.query.numel() * element_bytes
    gbps = total_bytes / kernel_us / 1e3
    sdpa_us = sdpa_gather_us = None
    if len(set(lens)) == 1:
        sdpa_us, sdpa_gather_us = _time_sdpa_decode(batch, lens[0], shape, timer, scale)
    launch = cuda_backend.decode_launch_for(  # the launch the backend made
        shape.batch,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        max(lens),
        str(dtype).removeprefix("torch."),
        device.index,
    )
    result = DecodeResult(
        label=shape.label,
        batch=shape.batch,
        mean_context=sum(lens) / len(lens),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=str(dtype).removeprefix("torch."),
        num_splits=launch.num_splits,
        kernel_us=kernel_us,
        gbps=gbps,
        pct_spec=100 * gbps / spec_gbps if spec_gbps else None,
        pct_copy_ceiling=100 * gbps / copy_gbps,
        sdpa_us=sdpa_us,
        sdpa_gather_us=sdpa_gather_us,
        speedup_vs_sdpa=sdpa_us / kernel_us if sdpa_us else None,
        speedup_vs_sdpa_gather=sdpa_gather_us / kernel_us if sdpa_gather_us else None,
    )
    print(_decode_line(result))
    return result


@dataclass(slots=True)
class DecodeVariant:
    """One way of running the kit's decode shape: which kernel, how many splits."""

    label: str
    group: int
    kernel: str
    num_splits: int
    kernel_us: float
    gbps: float
    pct_copy_ceiling: float


# (label, forced split count or None for the launcher's choice, tensor cores or None for the
# launcher's choice): the launcher's choice beside the alternatives it passed over.
DECODE_VARIANTS = (
    ("launcher's choice", None, None),
    *((f"tensor cores, {n} split{'s' * (n > 1)}", n, True) for n in (1, 2, 3, 4, 6)),
    ("CUDA cores, launcher's splits", None, False),
    ("CUDA cores, 1 split", 1, False),
)


@contextlib.contextmanager
def forced_decode(num_splits: int | None, tensor_cores: bool | None) -> Iterator[None]:
    """The launcher's split count and decode kernel replaced, for this process, while open."""
    saved = lc.choose_num_splits, lc.DECODE_TC_MIN_GROUP
    if num_splits is not None:
        lc.choose_num_splits = lambda *args, **kwargs: num_splits
    if tensor_cores is not None:
        lc.DECODE_TC_MIN_GROUP = 1 if tensor_cores else lc.DECODE_MAX_HEADS_PER_CTA**2
    try:
        yield
    finally:
        lc.choose_num_splits, lc.DECODE_TC_MIN_GROUP = saved


def bench_decode_variants(
    dtype: torch.dtype, device: torch.device, timer: Timer, copy_gbps: float
) -> list[DecodeVariant]:
    """The kit's decode shape (batch 64, context 4k, head_dim 128) for GQA groups 4 and 8,
    each way in DECODE_VARIANTS: what the launcher picks against what it could have."""
    results = []
    for group in KIT_BANDWIDTH_TARGET_GROUPS:
        torch.cuda.empty_cache()
        results += _bench_group_variants(group, dtype, device, timer, copy_gbps)
    return results


def _bench_group_variants(group, dtype, device, timer, copy_gbps) -> list[DecodeVariant]:
    num_heads, num_kv_heads, head_dim, batch_size, context = 8 * group, 8, 128, 64, 4096
    batch = build_paged_batch(
        [context] * batch_size, [1] * batch_size, num_heads, num_kv_heads, head_dim, dtype, device
    )
    out = torch.empty_like(batch.query)
    kv_bytes = batch_size * context * 2 * num_kv_heads * head_dim * dtype.itemsize
    total_bytes = kv_bytes + 2 * batch.query.numel() * dtype.itemsize
    dtype_name = str(dtype).removeprefix("torch.")

    def attend() -> None:
        cuda_backend.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, head_dim**-0.5, out
        )

    results = []
    for label, num_splits, tensor_cores in DECODE_VARIANTS:
        with forced_decode(num_splits, tensor_cores):
            kernel_us = timer.median_us(attend)
            launch = cuda_backend.decode_launch_for(
                batch_size, num_heads, num_kv_heads, head_dim, context, dtype_name, device.index
            )
        gbps = total_bytes / kernel_us / 1e3
        result = DecodeVariant(label, group, launch.kernel_name, launch.num_splits, kernel_us,
                               gbps, 100 * gbps / copy_gbps)  # fmt: skip
        print(
            f"decode variant group {group} {label:32s} splits={result.num_splits:2d} "
            f"{kernel_us:8.1f} us {gbps:6.0f} GB/s {result.pct_copy_ceiling:5.1f}% copy"
        )
        results.append(result)
    return results


def _time_sdpa_decode(batch, context_len, shape, timer, scale) -> tuple[float | None, float | None]:
    """SDPA on contiguous KV, then gather + SDPA; (None, None) if the copies do not fit."""
    q = batch.query.view(shape.batch, 1, shape.num_heads, shape.head_dim).transpose(1, 2)
    try:
        sdpa_us = _time_sdpa_contiguous(q, batch, context_len, timer, scale)
        sdpa_gather_us = timer.median_us(
            lambda: F.scaled_dot_product_attention(
                q,
                *(t.contiguous() for t in gather_kv(batch, context_len)),
                scale=scale,
                enable_gqa=True,
            )
        )
        return sdpa_us, sdpa_gather_us
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def _time_sdpa_contiguous(q, batch, context_len, timer, scale) -> float:
    keys, values = (t.contiguous() for t in gather_kv(batch, context_len))
    return timer.median_us(
        lambda: F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    )


def bench_prefill(
    num_reqs: int,
    query_len: int,
    context_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    label: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
) -> PrefillResult:
    batch = build_paged_batch(
        [context_len] * num_reqs,
        [query_len] * num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        device,
    )
    scale = head_dim**-0.5
    out = torch.empty_like(batch.query)
    kernel_us = timer.median_us(
        lambda: cuda_backend.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, scale, out
        )
    )
    # Causal FLOPs: each query token attends to context_len - query_len + i + 1 keys.
    visible = num_reqs * (query_len * (context_len - query_len) + query_len * (query_len + 1) / 2)
    flops = 4 * num_heads * head_dim * visible
    sdpa_us = sdpa_backend = None
    if query_len == context_len:
        q = torch.randn(num_reqs, num_heads, query_len, head_dim, dtype=dtype, device=device)
        k = torch.randn(num_reqs, num_kv_heads, query_len, head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        sdpa_us, sdpa_backend = _time_sdpa_prefill(q, k, v, scale, timer)
    result = PrefillResult(
        label=label,
        batch=num_reqs,
        query_len=query_len,
        context_len=context_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        kernel_us=kernel_us,
        kernel_tflops=flops / kernel_us / 1e6,
        sdpa_us=sdpa_us,
        sdpa_tflops=flops / sdpa_us / 1e6 if sdpa_us else None,
        ratio_vs_sdpa=sdpa_us / kernel_us if sdpa_us else None,
        sdpa_backend=sdpa_backend,
    )
    print(_prefill_line(result))
    return result


def _time_sdpa_prefill(q, k, v, scale, timer) -> tuple[float, str]:
    """Causal SDPA on its FlashAttention backend: GQA native if flash takes it, else with K/V
    repeated to every query head (outside the timing); torch's default choice where flash
    refuses both. Returns (µs, the backend that ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash(keys, values, **kwargs):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, **kwargs
            )

    group = q.shape[1] // k.shape[1]
    repeated = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    attempts = [
        ("flash", lambda: flash(k, v, enable_gqa=True)),
        ("flash (K/V repeated per head)", lambda: flash(*repeated)),
    ]
    for name, run in attempts:
        try:
            run()
        except RuntimeError as error:
            print(f"  (SDPA {name} refused this shape: {str(error).splitlines()[0]})")
            continue
        return timer.median_us(run), name
    return timer.median_us(
        lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
    ), "default"


def check_targets(decode: list[DecodeResult], prefill: list[PrefillResult]) -> list[dict]:
    """The kernels' targets (decode bandwidth against the copy ceiling and against SDPA,
    prefill against SDPA), evaluated on this run."""
    targets = []
    for result in decode:
        if result.label == "target: b64 ctx4k":
            targets.append(
                _target("decode b64 ctx4k >= 80% of copy ceiling", result.pct_copy_ceiling, 80.0)
            )
            if result.speedup_vs_sdpa is not None:
                targets.append(
                    _target(
                        "decode b64 ctx4k faster than SDPA without gather",
                        result.speedup_vs_sdpa,
                        1.0,
                    )
                )
        if result.label == "target: b1 ctx32k":
            targets.append(
                _target("decode b1 ctx32k >= 60% of copy ceiling", result.pct_copy_ceiling, 60.0)
            )
        group = result.num_heads // result.num_kv_heads
        if result.label.startswith("kit: b64 ctx4k") and group in KIT_BANDWIDTH_TARGET_GROUPS:
            name = f"decode b64 ctx4k group {group} >= {KIT_DECODE_PCT_COPY:.0f}% of copy ceiling"
            targets.append(_target(name, result.pct_copy_ceiling, KIT_DECODE_PCT_COPY))
    for result in prefill:
        if result.label == "target: prefill" and result.ratio_vs_sdpa is not None:
            targets.append(_target("prefill >= 0.5x SDPA", result.ratio_vs_sdpa, 0.5))
        if result.label.startswith("kit: prefill") and result.ratio_vs_sdpa is not None:
            name = (
                f"prefill {result.query_len} tokens >= {KIT_PREFILL_VS_SDPA}x SDPA "
                f"({result.sdpa_backend})"
            )
            targets.append(_target(name, result.ratio_vs_sdpa, KIT_PREFILL_VS_SDPA))
    for target in targets:
        print(f"{'PASS' if target['met'] else 'FAIL'}: {target['name']} ({target['value']:.2f})")
    return targets


def _target(name: str, value: float, threshold: float) -> dict:
    return {"name": name, "value": value, "threshold": threshold, "met": value >= threshold}


def write_report(report: dict, out_dir: Path, suffix: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", report["device"]).strip("_").lower()
    stem = f"attention_{slug}{suffix}"
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {out_dir / stem}.json and .md")


def markdown(report: dict) -> str:
    lines = [
        f"# Paged attention on {report['device']} ({report['dtype']})",
        "",
        f"torch {report['torch']}, {report['time']}. Copy ceiling "
        f"{report['copy_ceiling_gbps']:.0f} GB/s, spec {report['spec_bandwidth_gbps'] or '?'} GB/s.",
        "",
        "## Decode",
        "",
        "| shape | batch | mean ctx | Hq/Hkv/D | splits | µs | GB/s | % spec | % copy | "
        "SDPA µs | SDPA+gather µs | x SDPA | x SDPA+gather |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["decode"]:
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['mean_context']:.0f} | "
            f"{r['num_heads']}/{r['num_kv_heads']}/{r['head_dim']} | {r['num_splits']} | "
            f"{r['kernel_us']:.1f} | {r['gbps']:.0f} | {_fmt(r['pct_spec'])} | "
            f"{r['pct_copy_ceiling']:.0f} | {_fmt(r['sdpa_us'])} | {_fmt(r['sdpa_gather_us'])} | "
            f"{_fmt(r['speedup_vs_sdpa'], 2)} | {_fmt(r['speedup_vs_sdpa_gather'], 2)} |"
        )
    lines += [
        "",
        "## Prefill",
        "",
        "| shape | batch | q len | ctx | Hq/Hkv/D | µs | TFLOP/s | SDPA µs | SDPA TFLOP/s | "
        "SDPA time / kernel time | SDPA backend |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["prefill"]:
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['query_len']} | {r['context_len']} | "
            f"{r['num_heads']}/{r['num_kv_heads']}/{r['head_dim']} | {r['kernel_us']:.1f} | "
            f"{r['kernel_tflops']:.1f} | {_fmt(r['sdpa_us'])} | {_fmt(r['sdpa_tflops'])} | "
            f"{_fmt(r['ratio_vs_sdpa'], 2)} | {r.get('sdpa_backend') or 'n/a'} |"
        )
    if report.get("decode_variants"):
        lines += [
            "",
            "## Decode, batch 64 x 4k: the launcher's choice and the alternatives",
            "",
            "| group | variant | kernel | splits | µs | GB/s | % copy |",
            "|---|---|---|---|---|---|---|",
        ]
        for v in report["decode_variants"]:
            lines.append(
                f"| {v['group']} | {v['label']} | `{v['kernel']}` | {v['num_splits']} | "
                f"{v['kernel_us']:.1f} | {v['gbps']:.0f} | {v['pct_copy_ceiling']:.1f} |"
            )
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {'PASS' if t['met'] else 'FAIL'}: {t['name']} ({t['value']:.2f})")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _decode_line(r: DecodeResult) -> str:
    return (
        f"decode {r.label:18s} b={r.batch:4d} ctx={r.mean_context:7.0f} "
        f"{r.num_heads}/{r.num_kv_heads}/{r.head_dim} splits={r.num_splits:3d} "
        f"{r.kernel_us:9.1f} us {r.gbps:6.0f} GB/s {r.pct_copy_ceiling:5.1f}% copy "
        f"sdpa={_fmt(r.sdpa_us)} gather={_fmt(r.sdpa_gather_us)}"
    )


def _prefill_line(r: PrefillResult) -> str:
    return (
        f"prefill {r.label:30s} b={r.batch} q={r.query_len} ctx={r.context_len} "
        f"{r.kernel_us:9.1f} us {r.kernel_tflops:6.1f} TFLOP/s sdpa={_fmt(r.sdpa_tflops)} TFLOP/s"
    )


if __name__ == "__main__":
    sys.exit(main())
