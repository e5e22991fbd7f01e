"""`DecodeGraphs`: decode steps replayed as CUDA graphs, one per padded batch size.

A decode step launches a few hundred small kernels (norms, linears, rotary, the KV write,
attention, ...) whose launch costs more host time than their device time at small and medium
batches. Captured once as a CUDA graph, the whole forward is one launch.

A graph replays fixed device addresses and fixed launch shapes, so:
- Its inputs live in static buffers the step fills in place: token ids, positions, slot mapping
  and sequence lengths are copied into the first B rows; the block tables are the model runner's
  own device block tables, whose address never changes (`BlockTable.commit` writes rows
  0..B-1 of them every step).
- A step of B decode requests replays the graph of the smallest captured size N >= B. Rows
  B..N-1 are padding requests of one token each: slot -1 (they write no KV), sequence length 1
  (they read one key of whatever block their stale block-table row names, which is harmless), and
  their hidden states are never read. Every row's query is one token, so `query_start_loc` is
  0..N and never changes.
- The graphs are captured with max_query_len 1 and max_seq_len max_model_len: the attention
  kernels size their grids for the longest context, and the CTAs past a request's own length
  exit at once.
- Only pure decode steps replay (every request one token, no drafts to verify); prefill, mixed
  and verification steps run eagerly.

The graphs share one memory pool and are captured from the largest size down (vLLM's order), so
the smaller ones reuse the larger ones' activation memory. `GraphCapture` is the one seam to the
device: `CudaGraphCapture` records CUDA graphs, and a test's fake can replay the captured
function eagerly on the CPU, where every other part of this file runs as it does on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from core_engine.kernels import AttentionMetadata

# vLLM's default shape of capture sizes: 1, 2, 4, then every multiple of 8.
SMALL_CAPTURE_SIZES = (1, 2, 4)
CAPTURE_SIZE_STEP = 8

# The model's forward over static inputs: (input_ids, positions, per-group metadata) -> hidden.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, list[AttentionMetadata]], torch.Tensor]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to `max_num_seqs`, and `max_num_seqs` itself, so that every
    decode batch the scheduler can form has a graph."""
    small = [size for size in SMALL_CAPTURE_SIZES if size <= max_num_seqs]
    steps = range(CAPTURE_SIZE_STEP, max_num_seqs + 1, CAPTURE_SIZE_STEP)
    return sorted({*small, *steps, max_num_seqs})


def resolve_capture_sizes(requested: Sequence[int] | None, max_num_seqs: int) -> list[int]:
    """The sizes to capture, ascending: `requested` (the config's `cuda_graph_sizes`, already
    checked to be positive) without those above `max_num_seqs`, which no step can fill, or the
    default list when None."""
    if requested is None:
        return default_capture_sizes(max_num_seqs)
    return sorted({size for size in requested if size <= max_num_seqs})


class CapturedGraph(Protocol):
    """A captured forward: `replay()` reruns its device work and rewrites `output`."""

    output: torch.Tensor

    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """Records `forward()` once, as it runs on the inputs' static buffers, and returns the graph.
    Graphs from one `GraphCapture` share a memory pool: only one of them runs at a time."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedGraph: ...


@dataclass(slots=True)
class _CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture:
    """`GraphCapture` of torch CUDA graphs in one shared memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedGraph:
        # One eager run on a side stream first, as torch asks: lazy state (kernels compiled,
        # workspaces, the allocator's blocks) is set up outside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return _CudaGraph(graph, output)


class DecodeGraphs:
    """The static decode inputs, and one captured forward per size in `sizes`.

    Invariant: between steps, rows 0..N-1 of every static buffer hold valid inputs for any N in
    `sizes` (padding rows: slot -1, sequence length 1); `run` restores it for the rows it pads.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        device: torch.device,
        block_tables: Sequence[torch.Tensor],
        max_model_len: int,
    ) -> None:
        """`block_tables`: per KV cache group, the runner's device block table (at least
        max(sizes) rows, its address fixed for the graphs' life)."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive and at least one, got {sizes!r}")
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]
        for table in block_tables:
            if table.shape[0] < largest:
                raise ValueError(
                    f"a block table of {table.shape[0]} rows cannot back a graph of {largest} "
                    "requests"
                )
        self.max_model_len = max_model_len
        self.block_tables = list(block_tables)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.slot_mappings = [
            torch.full((largest,), -1, dtype=torch.int64, device=device) for _ in block_tables
        ]
        self.graphs: dict[int, CapturedGraph] = {}
        self.capture_s = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self, forward: DecodeForward, capture: GraphCapture) -> None:
        """Captures one graph per size, largest first; `capture_s` is the time it took."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.graphs[size] = capture.capture(lambda size=size: self._forward(forward, size))
        self.capture_s = time.perf_counter() - start

    def can_run(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step is a decode step a captured graph covers."""
        return (
            bool(self.graphs)
            and max_query_len == 1
            and num_tokens == num_reqs
            and 0 < num_reqs <= self.max_size
        )

    def padded_size(self, num_reqs: int) -> int:
        """The smallest captured size that holds `num_reqs` requests."""
        return next(size for size in self.sizes if size >= num_reqs)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mappings: Sequence[torch.Tensor],
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Replays the graph for this decode step of B = len(input_ids) requests (its block
        tables already committed); hidden states [B, hidden], a view valid until the next run."""
        num_reqs = input_ids.shape[0]
        size = self.padded_size(num_reqs)
        self.input_ids[:num_reqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_reqs].copy_(positions, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(seq_lens, non_blocking=True)
        self.seq_lens[num_reqs:size].fill_(1)
        for static, slot_mapping in zip(self.slot_mappings, slot_mappings, strict=True):
            static[:num_reqs].copy_(slot_mapping, non_blocking=True)
            static[num_reqs:size].fill_(-1)
        graph = self.graphs[size]
        graph.replay()
        return graph.output[:num_reqs]

    def _forward(self, forward: DecodeForward, size: int) -> torch.Tensor:
        """The forward over the first `size` static rows, with metadata built afresh (so a
        backend's per-step plans are derived from the buffers' current values)."""
        group_metadata = [
            AttentionMetadata(
                slot_mapping=slot_mapping[:size],
                block_table=table[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            for table, slot_mapping in zip(self.block_tables, self.slot_mappings, strict=True)
        ]
        return forward(self.input_ids[:size], self.positions[:size], group_metadata)
