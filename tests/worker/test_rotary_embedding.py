"""RotaryEmbedding's angles on a CPU come from a table of positions 0 .. P - 1 that grows as
positions need (the C decode driver reads the same table): the same values as computing them
for the positions asked, for any position."""

from __future__ import annotations

import pytest
import torch

from core_engine.worker.model_executor.layers import MIN_ANGLE_TABLE_ROWS, RotaryEmbedding

ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


def angles_computed_for(rotary: RotaryEmbedding, positions: torch.Tensor):
    """The angles of `positions` as computed directly, in float64 (the reference)."""
    angles = positions.to(torch.float64)[:, None] * rotary.inv_freq.to(torch.float64)[None, :]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("rope_scaling", ROPE_SCALINGS)
def test_cpu_angles_match_the_positions_angles_anywhere(head_dim, rope_scaling):
    rotary = RotaryEmbedding(head_dim, 10000.0, rope_scaling)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 9000, 3, 40000], dtype=torch.int64)
    cos, sin = rotary(positions)
    assert cos.shape == sin.shape == (len(positions), head_dim // 2)
    assert cos.dtype == sin.dtype == torch.float32
    # float32 angles: the product rounds to 2^-24 of the angle, and cos/sin of that angle are
    # within 2 ulp; so within |angle| * 2^-23 of the float64 values.
    expected_cos, expected_sin = angles_computed_for(rotary, positions)
    bound = positions.to(torch.float64)[:, None] * rotary.inv_freq.double() * 2.0**-23 + 2e-7
    assert ((cos.double() - expected_cos).abs() <= bound).all()
    assert ((sin.double() - expected_sin).abs() <= bound).all()


def test_the_table_grows_by_doubling_and_never_shrinks():
    rotary = RotaryEmbedding(64, 10000.0, None)
    assert rotary.angle_table(1)[0].shape[0] == MIN_ANGLE_TABLE_ROWS
    grown = rotary.angle_table(MIN_ANGLE_TABLE_ROWS + 1)[0].shape[0]
    assert grown == 2 * MIN_ANGLE_TABLE_ROWS
    assert rotary.angle_table(10 * MIN_ANGLE_TABLE_ROWS)[0].shape[0] == 10 * MIN_ANGLE_TABLE_ROWS
    assert rotary.angle_table(5)[0].shape[0] == 10 * MIN_ANGLE_TABLE_ROWS


def test_the_rows_are_the_angles_the_forward_returns():
    """Row p of the table is what forward gives for position p (the C driver's source)."""
    rotary = RotaryEmbedding(64, 500000.0, None)
    positions = torch.tensor([5, 0, 70000, 123], dtype=torch.int64)
    cos, sin = rotary(positions)
    table_cos, table_sin = rotary.angle_table(70001)
    assert torch.equal(cos, table_cos[positions]) and torch.equal(sin, table_sin[positions])


def test_an_empty_step_has_no_angles():
    cos, sin = RotaryEmbedding(64, 10000.0, None)(torch.zeros(0, dtype=torch.int64))
    assert cos.shape == sin.shape == (0, 32)
