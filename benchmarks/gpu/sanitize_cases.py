"""One small case of every CUDA kernel, for `compute-sanitizer` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python -m benchmarks.gpu.sanitize_cases

Each case writes its new tokens with `reshape_and_cache` and runs two batches through
`cuda_backend.paged_attention`: a mixed one (decodes, a prompt, a chunk over a context) and one
long decode alone (which the decode kernel splits, whatever the GPU's size, then merges), so
every kernel launches at least once: reshape_and_cache,
decode on CUDA cores and on tensor cores, the split merge, prefill on CUDA cores and on tensor
cores, with and without a sliding window. Cases are small (a racecheck run of each kernel takes
seconds, not minutes) and every unused cache slot is NaN, so a read outside a request shows up
in the output as well as in the sanitizer. The output is checked against the torch reference
on the CPU (so that no attention kernel but ours runs on the GPU); the script exits 1 if a kernel the cases must launch did not run or an output
is wrong. Needs CUDA and CuPy.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from core_engine.kernels import AttentionMetadata, torch_reference
from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.kernels.cuda.module_loader import default_loader

BLOCK_SIZE = 16
# (seq_lens, query lens) of the batches: two decodes, a prompt and a chunk over a context;
# then one long decode, which leaves the GPU so idle that its keys are split.
BATCHES = (((1, 37, 45, 300), (1, 1, 45, 20)), ((1500,), (1,)))


@dataclass(frozen=True, slots=True)
class KernelCase:
    name: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    # The kernels (name expressions, by prefix) this case must launch.
    expected_kernels: tuple[str, ...] = ()


CASES = (
    KernelCase(
        "float32, group 1, d 64: CUDA-core decode and prefill, merge",
        torch.float32, 2, 2, 64,
        expected_kernels=("reshape_and_cache", "decode_attention<float", "prefill_attention<float",
                          "merge_attention_states<float"),
    ),
    KernelCase(
        "bf16, group 4, d 128: tensor-core decode and prefill, merge",
        torch.bfloat16, 8, 2, 128,
        expected_kernels=("decode_attention_tc<bf16_t", "prefill_attention_tc<bf16_t",
                          "merge_attention_states<bf16_t"),
    ),
    KernelCase(
        "bf16, group 3, d 64 (SmolLM2): CUDA-core decode, tensor-core prefill",
        torch.bfloat16, 9, 3, 64,
        expected_kernels=("decode_attention<bf16_t", "prefill_attention_tc<bf16_t, 64>"),
    ),
    KernelCase(
        "fp16, group 8, d 128, sliding window 100",
        torch.float16, 16, 2, 128, sliding_window=100,
        expected_kernels=("decode_attention_tc<half_t", "prefill_attention_tc<half_t"),
    ),
)  # fmt: skip


def build_inputs(case: KernelCase, seq_lens, query_lens, seed: int = 0):
    """(query, key, value, kv_cache, metadata) on the CPU: blocks in scrambled order, NaN in
    every slot no request owns."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 8
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    for row, count in enumerate(blocks_per_req):
        block_table[row, :count] = torch.tensor(order[:count])
        order = order[count:]
    slots, starts = [], [0]
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for position in range(seq_len - q_len, seq_len):
            block = int(block_table[row, position // BLOCK_SIZE])
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        starts.append(starts[-1] + q_len)
    shape = (2, num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=case.dtype)
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for position in range(seq_len - q_len):  # the cached context, written directly
            block = int(block_table[row, position // BLOCK_SIZE])
            kv_cache[:, block, position % BLOCK_SIZE] = torch.randn(
                2, case.num_kv_heads, case.head_dim, generator=generator
            ).to(case.dtype)
    num_tokens = starts[-1]

    def rows(heads):
        return torch.randn(num_tokens, heads, case.head_dim, generator=generator).to(case.dtype)

    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return (
        rows(case.num_heads),
        rows(case.num_kv_heads),
        rows(case.num_kv_heads),
        kv_cache,
        metadata,
    )


def _on(device: torch.device, metadata: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        *(t.to(device) for t in (metadata.slot_mapping, metadata.block_table, metadata.seq_lens,
                                 metadata.query_start_loc)),
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
    )  # fmt: skip


def run_case(case: KernelCase, device: torch.device) -> list[str]:
    """Runs the case's batches on the kernels and on the torch reference; returns what went
    wrong."""
    return [
        f"batch {seq_lens}: {problem}"
        for seq_lens, query_lens in BATCHES
        for problem in run_batch(case, seq_lens, query_lens, device)
    ]


def run_batch(case: KernelCase, seq_lens, query_lens, device: torch.device) -> list[str]:
    """The kernels on `device`, the torch reference on the CPU: under the sanitizer, only our
    kernels and torch's copies run on the GPU (torch's own attention kernels are not ours to
    check: racecheck flagged its memory-efficient SDPA in the first GPU run)."""
    query, key, value, reference_cache, metadata = build_inputs(case, seq_lens, query_lens)
    scale = case.head_dim**-0.5
    kv_cache = reference_cache.to(device)
    on_device = _on(device, metadata)
    cuda_backend.reshape_and_cache(
        key.to(device), value.to(device), kv_cache, on_device.slot_mapping
    )
    out = cuda_backend.paged_attention(
        query.to(device), kv_cache, on_device, scale, sliding_window=case.sliding_window
    ).cpu()
    kv_cache = kv_cache.cpu()
    torch_reference.reshape_and_cache(key, value, reference_cache, metadata.slot_mapping)
    expected = torch_reference.paged_attention(
        query.float(), reference_cache.float(), metadata, scale, sliding_window=case.sliding_window
    )
    problems = []
    written = ~torch.isnan(reference_cache)
    if not torch.equal(kv_cache[written], reference_cache[written]):
        problems.append("reshape_and_cache wrote other values than the reference")
    error = (out.float() - expected).abs().max().item()
    tolerance = 1e-4 if case.dtype == torch.float32 else 3e-2
    if not error <= tolerance:  # NaN fails too
        problems.append(f"max |out - reference| = {error:.3g} > {tolerance}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if not cuda_backend.is_available():
        print("needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    loader = default_loader()
    failed = False
    for case in CASES:
        before = loader.compiled_names()
        problems = run_case(case, device)
        launched = sorted(loader.compiled_names() - before)
        missing = [
            prefix
            for prefix in case.expected_kernels
            if not any(name.startswith(prefix) for name in launched)
        ]
        if missing:
            problems.append(f"kernels that did not run: {missing}")
        failed |= bool(problems)
        print(f"{'FAIL' if problems else 'ok'}: {case.name}: launched {launched}")
        for problem in problems:
            print(f"    {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
