"""StepTransfer: a step's arrays come back as tensors of their dtype, shape and values, from one
buffer that grows when a step needs more; other dtypes are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.worker.step_transfer import StepTransfer

CPU = torch.device("cpu")


def step_arrays(num_tokens: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 50_000, num_tokens, dtype=np.int64),  # token ids
        np.arange(num_tokens, dtype=np.int64),  # positions
        rng.integers(0, 1 << 20, (3, 5), dtype=np.int32),  # a block table's rows
        np.empty(0, dtype=np.int64),  # no sample rows this step
        rng.random(num_tokens % 7 + 1, dtype=np.float32),  # an odd number of 4-byte values
        rng.integers(0, 9, 1, dtype=np.int32),
    ]


def test_every_array_comes_back_with_its_dtype_shape_and_values():
    transfer = StepTransfer(CPU, capacity_bytes=64)
    for step, num_tokens in enumerate([3, 1000, 7, 5000]):  # grows past its capacity twice
        arrays = step_arrays(num_tokens, seed=step)
        tensors = transfer.send(arrays)
        assert len(tensors) == len(arrays)
        for array, tensor in zip(arrays, tensors, strict=True):
            assert tensor.device == CPU and tensor.shape == array.shape
            assert tensor.numpy().dtype == array.dtype
            assert np.array_equal(tensor.numpy(), array)
            assert tensor.data_ptr() % 8 == 0  # aligned for any of the dtypes


def test_a_strided_array_is_sent_as_its_values():
    matrix = np.arange(24, dtype=np.int64).reshape(4, 6)
    (column,) = StepTransfer(CPU).send([matrix[:, 2]])
    assert column.tolist() == [2, 8, 14, 20]


def test_another_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="int32, int64 or float32 arrays, got float64"):
        StepTransfer(CPU).send([np.zeros(3)])
