"""BlockTable: exact slot mapping, row edits, bounds errors."""

import numpy as np
import pytest
import torch

from core_engine.worker.block_table import BlockTable


def make_table(max_num_reqs: int = 4, max_blocks: int = 3, block_size: int = 4) -> BlockTable:
    return BlockTable(max_num_reqs, max_blocks, block_size, torch.device("cpu"))


def test_slot_mapping_exact_values():
    table = make_table()
    table.add_row([3, 7], 0)
    table.add_row([5], 1)
    req_rows = np.array([0, 0, 0, 0, 0, 1, 1])
    positions = np.array([0, 3, 4, 5, 7, 0, 2])
    slots = table.compute_slot_mapping(req_rows, positions)
    assert slots.dtype == np.int64
    assert slots.tolist() == [12, 15, 28, 29, 31, 20, 22]


def test_append_extends_and_add_replaces():
    table = make_table()
    table.add_row([1], 2)
    table.append_row([9, 4], 2)
    assert table.block_table_np[2, :3].tolist() == [1, 9, 4]
    assert table.num_blocks_per_row[2] == 3
    table.add_row([6], 2)
    assert table.num_blocks_per_row[2] == 1
    assert table.compute_slot_mapping(np.array([2]), np.array([1])).tolist() == [25]


def test_move_row_copies_blocks_and_clear_row_empties():
    table = make_table()
    table.add_row([8, 2], 3)
    table.move_row(3, 0)
    table.clear_row(3)
    assert table.block_table_np[0, :2].tolist() == [8, 2]
    assert table.num_blocks_per_row.tolist() == [2, 0, 0, 0]


def test_commit_returns_committed_rows():
    table = make_table()
    table.add_row([1, 2, 3], 0)
    table.add_row([4], 1)
    committed = table.commit(2)
    assert committed.dtype == torch.int32
    assert committed.shape == (2, 3)
    assert committed[0].tolist() == [1, 2, 3]
    assert committed[1, 0].item() == 4


def test_position_without_block_raises():
    table = make_table()
    table.add_row([3], 0)
    with pytest.raises(ValueError, match="position 4 .* holds 1 blocks"):
        table.compute_slot_mapping(np.array([0]), np.array([4]))


def test_too_many_blocks_raises():
    table = make_table(max_blocks=2)
    table.add_row([1, 2], 0)
    with pytest.raises(ValueError, match="3 KV blocks, more than the 2"):
        table.append_row([3], 0)
