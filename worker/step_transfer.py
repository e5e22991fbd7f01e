"""`StepTransfer`: a step's host arrays sent to the device in one copy.

A step's inputs are a handful of small numpy arrays (token ids, positions, slot mappings,
sequence lengths, ...). Copied one by one from pageable memory, each is a synchronous transfer on
a GPU, and the host waits for the device at every one. Here they are staged into one host byte
buffer (pinned on a CUDA device, so the copy is asynchronous), copied with one `copy_`, and
handed out as typed views of one device buffer. On a CPU device there is nothing to transfer:
each array comes back copied into a tensor of its own (cheaper than the views' torch calls).

Invariant (device): the views returned by `send` stay valid until the next `send`, which reuses
both buffers. The next step's staging may overwrite the pinned buffer because every step ends with
the host waiting for its sampled ids (so the last copy has landed), and its copy into the device
buffer is ordered after this step's kernels on the device's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGNMENT_BYTES = 8
TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


class StepTransfer:
    """One staging buffer and one device buffer, grown to the largest step seen."""

    def __init__(self, device: torch.device, capacity_bytes: int = 1 << 16) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.uint8)
        self._staging = self._host.numpy()
        self._device = self._host
        self._reserve(capacity_bytes)

    def send(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays (int32, int64 or float32, any shape) as device tensors of their dtype and
        shape, in one host-to-device copy. ValueError for another dtype."""
        offsets, end = self._layout(arrays)
        if self.device.type == "cpu":  # ~2 us an array; the staging views cost ~7 us an array
            return [torch.from_numpy(np.array(array, order="C")) for array in arrays]
        self._reserve(end)
        for array, offset in zip(arrays, offsets, strict=True):
            flat = np.ascontiguousarray(array).reshape(-1)
            self._staging[offset : offset + flat.nbytes] = flat.view(np.uint8)
        if self._device is not self._host:
            self._device[:end].copy_(self._host[:end], non_blocking=True)
        return [
            self._device[offset : offset + array.nbytes]
            .view(TORCH_DTYPES[array.dtype])
            .view(array.shape)
            for array, offset in zip(arrays, offsets, strict=True)
        ]

    @staticmethod
    def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for array in arrays:
            if array.dtype not in TORCH_DTYPES:
                raise ValueError(
                    f"a step transfer takes int32, int64 or float32 arrays, got {array.dtype}"
                )
            offsets.append(end)
            end += -(-array.nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        return offsets, end

    def _reserve(self, num_bytes: int) -> None:
        if num_bytes <= self._host.numel():
            return
        capacity = max(num_bytes, 2 * self._host.numel())
        on_cpu = self.device.type == "cpu"
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=not on_cpu)
        self._staging = self._host.numpy()  # the same bytes, written by numpy
        self._device = (
            self._host if on_cpu else torch.empty(capacity, dtype=torch.uint8, device=self.device)
        )
