"""Grid, block, shared-memory and split decisions for the CUDA kernels: pure Python, no torch.

Everything the launcher decides before calling a kernel lives here so that it can be unit-tested
without a GPU. The constants mirror the `constexpr` values at the top of the `.cu` files (a test
checks that they agree); change both together.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from core_engine.common.math_utils import cdiv, round_up

MAX_GRID_Y = 65535
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
DEFAULT_SHARED_MEM_BYTES = 48 * 1024
# Passed as keys_per_split when decode runs unsplit: every request's whole context is one split.
UNSPLIT_KEYS_PER_SPLIT = 2**31 - 1
# The kernels take the window as an int32 (0 = none).
MAX_SLIDING_WINDOW = 2**31 - 1

# decode_attention.cu
DECODE_THREADS = 128
DECODE_WARPS = DECODE_THREADS // 32
DECODE_MAX_HEADS_PER_CTA = 8
DECODE_TC_KEYS = 16  # keys per warp tile of decode_attention_tc
# decode_attention_tc serves fp16 / bf16 GQA groups of at least this many heads.
DECODE_TC_MIN_GROUP = 4
# prefill_attention.cu
PREFILL_THREADS = 256
PREFILL_ROWS = 64
PREFILL_KEYS = 32
PREFILL_ROW_PAD = 4
PREFILL_PROB_STRIDE = PREFILL_KEYS + 1
# prefill_attention_tc.cu (tensor cores: fp16 / bf16, head_dim % 16 == 0)
PREFILL_TC_THREADS = 128
PREFILL_TC_ROWS = 64
PREFILL_TC_KEYS = 64
PREFILL_TC_PAD = 8
PREFILL_TC_STAGES = 2
PREFILL_TC_MAX_REGISTER_Q_DIM = 128
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
# merge_attention_states.cu
MERGE_THREADS = 128
# reshape_and_cache.cu
CACHE_WRITE_MAX_THREADS = 128
VECTOR_BYTES = 16

DTYPE_TO_CUDA_TYPE = {"float32": "float", "float16": "half_t", "bfloat16": "bf16_t"}

Dim3 = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """When decode splits the KV range of a request over several CTAs.

    Where the kernel's occupancy is known (`resident_ctas_per_sm`, read from the compiled
    kernel on a GPU), the split count minimizes the time of a grid that runs in waves of
    `resident_ctas_per_sm * num_sms` CTAs: waves x (keys per split + `split_overhead_keys`).
    A last wave of a few CTAs leaves most SMs idle for as long as a full one (first GPU run:
    512 unsplit CTAs of the tensor-core decode, 3 resident per SM on 132 SMs, read K/V at 72%
    of the rate of the CUDA-core kernel's single wave); splitting fills it. Where it is not
    known, decode is unsplit while it already has `min_ctas_per_sm` CTAs per SM, and otherwise
    splits each request's context so that about `target_ctas_per_sm` CTAs per SM run. Either
    way a split has at least `min_keys_per_split` keys (rounded up to `key_alignment`) and
    there are at most `max_splits`.
    """

    min_ctas_per_sm: int = 2
    target_ctas_per_sm: int = 4
    min_keys_per_split: int = 256
    key_alignment: int = 128
    max_splits: int = 64
    # A CTA's fixed cost (query load, merge traffic, launch) in keys' worth of time.
    split_overhead_keys: int = 64


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """Launch of decode_attention (and merge_attention_states when `num_splits > 1`).

    Split z of a request covers keys [begin + z * keys_per_split, + keys_per_split) of the keys
    its query attends to, [begin, seq_len) (begin > 0 only before a sliding window); the splits
    cover the most keys any request attends to, `max_attended_keys`.
    """

    grid: Dim3
    block: Dim3
    shared_mem_bytes: int
    heads_per_cta: int
    num_head_chunks: int
    num_splits: int
    keys_per_split: int
    merge_grid: Dim3
    merge_block: Dim3
    kernel_name: str = ""
    uses_tensor_cores: bool = False

    @property
    def needs_merge(self) -> bool:
        return self.num_splits > 1


@dataclass(frozen=True, slots=True)
class PrefillLaunch:
    """Launch of the prefill kernel in `source_name` / `kernel_name` (same arguments for both).

    `tokens_per_tile * group_size <= PREFILL_ROWS` (both kernels have 64 rows per CTA).
    """

    grid: Dim3
    block: Dim3
    shared_mem_bytes: int
    tokens_per_tile: int
    source_name: str
    kernel_name: str

    @property
    def uses_tensor_cores(self) -> bool:
        return self.source_name == "prefill_attention_tc.cu"


@dataclass(frozen=True, slots=True)
class CacheWriteLaunch:
    """Launch of reshape_and_cache: one CTA per token, `row_vecs` 16-byte vectors per K/V row."""

    grid: Dim3
    block: Dim3
    row_vecs: int


def check_head_dim(head_dim: int) -> None:
    """Raises ValueError unless the kernels support `head_dim` (a multiple of 8, at most 256)."""
    if head_dim <= 0 or head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} is not supported by the CUDA kernels: it must be a positive "
            f"multiple of {HEAD_DIM_MULTIPLE} and at most {MAX_HEAD_DIM}"
        )


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Returns the GQA group size; raises ValueError if num_heads is not a multiple of num_kv_heads."""
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
        )
    return num_heads // num_kv_heads


def check_num_reqs(num_reqs: int) -> None:
    if num_reqs > MAX_GRID_Y:
        raise ValueError(
            f"num_reqs={num_reqs} exceeds the CUDA grid limit of {MAX_GRID_Y} requests per launch"
        )


def cuda_type(dtype_name: str) -> str:
    """The CUDA C storage type for a torch dtype name ("bfloat16" -> "bf16_t")."""
    if dtype_name not in DTYPE_TO_CUDA_TYPE:
        raise ValueError(
            f"dtype {dtype_name} is not supported by the CUDA kernels; "
            f"use one of {sorted(DTYPE_TO_CUDA_TYPE)}"
        )
    return DTYPE_TO_CUDA_TYPE[dtype_name]


def decode_kernel_name(dtype_name: str, head_dim: int, heads_per_cta: int) -> str:
    return f"decode_attention<{cuda_type(dtype_name)}, {head_dim}, {heads_per_cta}>"


def decode_tc_kernel_name(dtype_name: str, head_dim: int, heads_per_cta: int) -> str:
    return f"decode_attention_tc<{cuda_type(dtype_name)}, {head_dim}, {heads_per_cta}>"


def decode_uses_tensor_cores(dtype_name: str, group_size: int) -> bool:
    """fp16 / bf16 groups of >= DECODE_TC_MIN_GROUP heads: one MMA serves the group's heads, so
    K/V live once per warp instead of once per head (group 8 is not register-bound)."""
    return dtype_name in TENSOR_CORE_DTYPES and group_size >= DECODE_TC_MIN_GROUP


def decode_kernel_name_for(dtype_name: str, head_dim: int, group_size: int) -> str:
    """The decode kernel a group of this size runs: decode_attention_tc when
    `decode_uses_tensor_cores`, else decode_attention; `head_chunking`'s heads per CTA."""
    heads_per_cta, _ = head_chunking(group_size)
    if decode_uses_tensor_cores(dtype_name, group_size):
        return decode_tc_kernel_name(dtype_name, head_dim, heads_per_cta)
    return decode_kernel_name(dtype_name, head_dim, heads_per_cta)


def block_divider(block_size: int) -> tuple[int, int]:
    """(block_magic, block_shift) for the decode kernels' division by `block_size`:
    block index = (mulhi(pos, magic) + pos) >> shift for every 0 <= pos < 2**31.

    A power-of-two block size gives magic 0, a plain shift; others a round-up fast-divide.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    shift = (block_size - 1).bit_length()  # ceil(log2(block_size))
    if block_size == 1 << shift:
        return 0, shift
    magic = (1 << 32) * ((1 << shift) - block_size) // block_size + 1
    return magic, shift


def prefill_kernel_name(dtype_name: str, head_dim: int) -> str:
    return f"prefill_attention<{cuda_type(dtype_name)}, {head_dim}>"


def prefill_tc_kernel_name(dtype_name: str, head_dim: int) -> str:
    return f"prefill_attention_tc<{cuda_type(dtype_name)}, {head_dim}>"


def merge_kernel_name(dtype_name: str) -> str:
    return f"merge_attention_states<{cuda_type(dtype_name)}>"


CACHE_WRITE_KERNEL_NAME = "reshape_and_cache"


def head_chunking(group_size: int) -> tuple[int, int]:
    """Splits a GQA group into (heads_per_cta, num_head_chunks), heads_per_cta <= 8.

    Chunks are as even as possible; the last one may be partial (the kernel masks its tail).
    """
    num_chunks = cdiv(group_size, DECODE_MAX_HEADS_PER_CTA)
    return cdiv(group_size, num_chunks), num_chunks


def decode_shared_mem_bytes(heads_per_cta: int, head_dim: int) -> int:
    """Per-warp maxima and sums [warps][heads] plus accumulators [warps][heads][head_dim], fp32."""
    return 4 * DECODE_WARPS * heads_per_cta * (2 + head_dim)


def check_sliding_window(sliding_window: int | None) -> int:
    """The kernels' `sliding_window` argument: 0 for None (no window), else the window.

    Raises ValueError unless the window is None or a positive int32 (`keys per query`).
    """
    if sliding_window is None:
        return 0
    if not 0 < sliding_window <= MAX_SLIDING_WINDOW:
        raise ValueError(
            f"sliding_window={sliding_window} must be None or between 1 and {MAX_SLIDING_WINDOW}"
        )
    return sliding_window


def max_attended_keys(max_seq_len: int, sliding_window: int | None) -> int:
    """The most keys one decode query attends to: min(max_seq_len, sliding_window)."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window)


def choose_num_splits(
    num_base_ctas: int,
    max_keys: int,
    num_sms: int,
    policy: SplitPolicy = SplitPolicy(),
    resident_ctas_per_sm: int | None = None,
) -> int:
    """How many KV splits decode uses for at most `max_keys` keys per request (see
    `SplitPolicy`); 1 when splitting would not make the grid finish sooner."""
    by_length = max(1, min(max_keys // policy.min_keys_per_split, policy.max_splits))
    if resident_ctas_per_sm is not None:
        return _fewest_waves_split(num_base_ctas, max_keys, num_sms * resident_ctas_per_sm,
                                   by_length, policy)  # fmt: skip
    if num_base_ctas >= policy.min_ctas_per_sm * num_sms:
        return 1
    base = max(num_base_ctas, 1)
    by_occupancy = max(2, (policy.target_ctas_per_sm * num_sms + base // 2) // base)  # nearest
    return max(1, min(by_occupancy, by_length))


@functools.lru_cache(maxsize=4096)
def _fewest_waves_split(
    num_base_ctas: int, max_keys: int, wave_ctas: int, most_splits: int, policy: SplitPolicy
) -> int:
    """The split count in 1..most_splits with the least waves x (keys per split + overhead);
    the fewest splits among equals. Cached: every layer of a step asks the same question, and
    the search tries up to max_splits counts."""
    base = max(num_base_ctas, 1)
    best, best_cost = 1, None
    for wanted in range(1, most_splits + 1):
        num_splits, keys_per_split = split_keys(max_keys, wanted, policy)
        keys = max_keys if num_splits == 1 else keys_per_split
        cost = cdiv(base * num_splits, max(wave_ctas, 1)) * (keys + policy.split_overhead_keys)
        if best_cost is None or cost < best_cost:
            best, best_cost = num_splits, cost
    return best


def split_keys(
    max_keys: int, num_splits: int, policy: SplitPolicy = SplitPolicy()
) -> tuple[int, int]:
    """(num_splits, keys_per_split) covering max_keys keys with no empty trailing split.

    keys_per_split is a multiple of `policy.key_alignment`; num_splits may shrink after rounding.
    With one split, keys_per_split is UNSPLIT_KEYS_PER_SPLIT.
    """
    if num_splits <= 1:
        return 1, UNSPLIT_KEYS_PER_SPLIT
    keys_per_split = round_up(cdiv(max_keys, num_splits), policy.key_alignment)
    num_splits = cdiv(max_keys, keys_per_split)
    if num_splits <= 1:
        return 1, UNSPLIT_KEYS_PER_SPLIT
    return num_splits, keys_per_split


def decode_launch(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    num_sms: int,
    policy: SplitPolicy = SplitPolicy(),
    sliding_window: int | None = None,
    dtype_name: str = "float32",
    resident_ctas_per_sm: int | None = None,
) -> DecodeLaunch:
    """Grid x = kv_head * num_head_chunks + chunk, y = request, z = split.

    Splits are sized by the keys a query attends to (its window, when shorter than max_seq_len),
    and counted by `choose_num_splits` (with the kernel's occupancy, when the caller knows it).
    The kernel: `decode_kernel_name_for`.
    """
    check_head_dim(head_dim)
    check_num_reqs(num_reqs)
    group_size = check_heads(num_heads, num_kv_heads)
    heads_per_cta, num_head_chunks = head_chunking(group_size)
    num_base_ctas = num_reqs * num_kv_heads * num_head_chunks
    max_keys = max_attended_keys(max_seq_len, sliding_window)
    wanted = choose_num_splits(num_base_ctas, max_keys, num_sms, policy, resident_ctas_per_sm)
    num_splits, keys_per_split = split_keys(max_keys, wanted, policy)
    tensor_cores = decode_uses_tensor_cores(dtype_name, group_size)
    return DecodeLaunch(
        grid=(num_kv_heads * num_head_chunks, num_reqs, num_splits),
        block=(DECODE_THREADS, 1, 1),
        shared_mem_bytes=decode_shared_mem_bytes(heads_per_cta, head_dim),
        heads_per_cta=heads_per_cta,
        num_head_chunks=num_head_chunks,
        num_splits=num_splits,
        keys_per_split=keys_per_split,
        merge_grid=(num_heads, num_reqs, 1),
        merge_block=(MERGE_THREADS, 1, 1),
        kernel_name=decode_kernel_name_for(dtype_name, head_dim, group_size),
        uses_tensor_cores=tensor_cores,
    )


def prefill_tokens_per_tile(group_size: int) -> int:
    """Query tokens per prefill CTA: as many whole GQA groups as fit in PREFILL_ROWS rows."""
    if group_size > PREFILL_ROWS:
        raise ValueError(
            f"GQA group size {group_size} exceeds the prefill kernel's {PREFILL_ROWS} rows per CTA"
        )
    return PREFILL_ROWS // group_size


def prefill_shared_mem_bytes(head_dim: int) -> int:
    """fp32 Q [rows][d+pad], K and V [keys][d+pad], probabilities [rows][keys+1]."""
    row_floats = head_dim + PREFILL_ROW_PAD
    return 4 * ((PREFILL_ROWS + 2 * PREFILL_KEYS) * row_floats + PREFILL_ROWS * PREFILL_PROB_STRIDE)


def prefill_uses_tensor_cores(dtype_name: str, head_dim: int) -> bool:
    """fp16 / bf16 with head_dim % 16 == 0 run on tensor cores; the rest on CUDA cores (fp32)."""
    return dtype_name in TENSOR_CORE_DTYPES and head_dim % 16 == 0


def prefill_tc_shared_mem_bytes(head_dim: int) -> int:
    """16-bit K and V tiles [keys][d+pad], double-buffered; Q [rows][d+pad] is staged in the
    second K buffer, except above PREFILL_TC_MAX_REGISTER_Q_DIM where it keeps its own buffer."""
    tiles = 2 * PREFILL_TC_STAGES + (head_dim > PREFILL_TC_MAX_REGISTER_Q_DIM)
    return 2 * tiles * PREFILL_TC_KEYS * (head_dim + PREFILL_TC_PAD)


def prefill_launch(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    dtype_name: str = "float32",
) -> PrefillLaunch:
    """Grid x = query tile, y = request, z = kv_head; tiles past a request's q_len exit at once."""
    check_head_dim(head_dim)
    check_num_reqs(num_reqs)
    group_size = check_heads(num_heads, num_kv_heads)
    tokens_per_tile = prefill_tokens_per_tile(group_size)
    grid = (cdiv(max_query_len, tokens_per_tile), num_reqs, num_kv_heads)
    if prefill_uses_tensor_cores(dtype_name, head_dim):
        return PrefillLaunch(
            grid=grid,
            block=(PREFILL_TC_THREADS, 1, 1),
            shared_mem_bytes=prefill_tc_shared_mem_bytes(head_dim),
            tokens_per_tile=tokens_per_tile,
            source_name="prefill_attention_tc.cu",
            kernel_name=prefill_tc_kernel_name(dtype_name, head_dim),
        )
    return PrefillLaunch(
        grid=grid,
        block=(PREFILL_THREADS, 1, 1),
        shared_mem_bytes=prefill_shared_mem_bytes(head_dim),
        tokens_per_tile=tokens_per_tile,
        source_name="prefill_attention.cu",
        kernel_name=prefill_kernel_name(dtype_name, head_dim),
    )


def cache_write_launch(num_tokens: int, row_bytes: int) -> CacheWriteLaunch:
    """One CTA per token; `row_bytes` (one token's K or V, all kv heads) must be 16-byte whole."""
    if row_bytes % VECTOR_BYTES:
        raise ValueError(
            f"a K/V row of {row_bytes} bytes is not a multiple of {VECTOR_BYTES} bytes"
        )
    row_vecs = row_bytes // VECTOR_BYTES
    threads = min(CACHE_WRITE_MAX_THREADS, round_up(row_vecs, 32))
    return CacheWriteLaunch(grid=(num_tokens, 1, 1), block=(threads, 1, 1), row_vecs=row_vecs)
