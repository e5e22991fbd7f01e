"""Physical KV block ids of every request in the persistent batch, and slot mapping from them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockTable:
    """Rows of physical block ids, one row per batch slot, kept on the host and mirrored to a device.

    Invariants: `block_table_np[row, :num_blocks_per_row[row]]` are the row's block ids in
    logical order (block i holds positions `i * block_size ... (i + 1) * block_size - 1`); entries
    past `num_blocks_per_row[row]` are stale and never read. The device tensor is only valid for
    the rows passed to the last `commit`.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_size = block_size
        self.device = device
        # Pinned on a GPU worker, so `commit` is an asynchronous DMA rather than a host copy
        # into a staging buffer. The host may rewrite rows for the next step while that copy
        # could still be in flight only if a step ended without waiting for its sampled ids,
        # which every step does.
        self._block_table_cpu = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req),
            dtype=torch.int32,
            pin_memory=device.type != "cpu",
        )
        self.block_table_np = self._block_table_cpu.numpy()  # the same memory
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        if device.type == "cpu":
            self._block_table_device = self._block_table_cpu
        else:
            self._block_table_device = torch.zeros(
                (max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device
            )

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Replaces the row's blocks with `block_ids` (a new or resumed request)."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Appends `block_ids` after the row's current blocks."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request in row {row} would hold {end} KV blocks, more than the "
                f"{self.max_num_blocks_per_req} that max_model_len allows"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        """Copies row `src` into row `dst` (used when the batch is condensed)."""
        num_blocks = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[dst] = num_blocks

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def compute_slot_mapping(self, req_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: `block_table[row, pos // block_size] * block_size + pos % block_size`.

        `req_rows[i]` is token i's batch row and `positions[i]` its position in its request;
        returns int64 of the same length. Raises if a position lies past the row's blocks.
        """
        block_indices = positions // self.block_size
        if np.any(block_indices >= self.num_blocks_per_row[req_rows]):
            bad = int(np.argmax(block_indices >= self.num_blocks_per_row[req_rows]))
            raise ValueError(
                f"position {int(positions[bad])} of the request in row {int(req_rows[bad])} has "
                f"no KV block: the row holds {int(self.num_blocks_per_row[req_rows[bad]])} "
                f"blocks of {self.block_size} tokens"
            )
        block_ids = self.block_table_np[req_rows, block_indices].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size

    @property
    def device_table(self) -> torch.Tensor:
        """The device copy, all `max_num_reqs` rows; its address never changes (a CUDA graph
        reads it). Rows from the last `commit`'s count on are stale."""
        return self._block_table_device

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Copies rows `0..num_reqs-1` to the device; returns int32 [num_reqs, max_num_blocks_per_req]."""
        if self._block_table_device is not self._block_table_cpu:
            self._block_table_device[:num_reqs].copy_(
                self._block_table_cpu[:num_reqs], non_blocking=True
            )
        return self._block_table_device[:num_reqs]


class MultiGroupBlockTable:
    """One `BlockTable` per KV cache group (see common.kv_cache_groups); a request has the same
    row in every group. Block ids come per group: `block_ids[g]` for group g."""

    def __init__(
        self,
        num_groups: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_tables = [
            BlockTable(max_num_reqs, max_num_blocks_per_req, block_size, device)
            for _ in range(num_groups)
        ]

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]

    def __len__(self) -> int:
        return len(self.block_tables)

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Replaces the row's blocks in every group (a new or resumed request)."""
        for table, group_block_ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(group_block_ids, row)

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Appends each group's new blocks; no lists at all: nothing new in any group."""
        if not block_ids:
            return
        for table, group_block_ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(group_block_ids, row)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.block_tables:
            table.move_row(src, dst)

    def clear_row(self, row: int) -> None:
        for table in self.block_tables:
            table.clear_row(row)
