"""`HostKVTier`: one rank's offloaded KV blocks in host memory, slot by slot, and the copies
between it and the device's per-layer caches."""

from __future__ import annotations

import torch

from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout


class HostKVTier:
    """`num_slots` blocks of `layout`, [slot, layer, K/V, token, head, dim]: one slot is one
    contiguous block (what a block file holds). Pinned when the device is a GPU, so copies to
    and from it run at full speed. Which hash sits in which slot is the scheduler's to say."""

    def __init__(
        self, layout: KVBlockLayout, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        pin = device.type == "cuda"
        # torch.empty: on CPU, pages nobody wrote cost no memory, so a large tier costs what
        # it holds.
        self.blocks = torch.empty((num_slots, *layout.shape), dtype=dtype, pin_memory=pin)
        self.layout = layout

    @property
    def num_slots(self) -> int:
        return self.blocks.shape[0]

    @property
    def bytes_per_block(self) -> int:
        return self.blocks[0].numel() * self.blocks.element_size()

    def write_slots(self, slots: list[int], data: torch.Tensor) -> None:
        """`data[i]` ([layer, K/V, token, head, dim]) into slot `slots[i]`."""
        self.blocks[torch.tensor(slots, dtype=torch.int64)] = data

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        return self.blocks[torch.tensor(slots, dtype=torch.int64)]


def gather_device_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The device blocks `block_ids` of every layer's cache ([K/V, block, token, head, dim]),
    on the host as [block, layer, K/V, token, head, dim]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0].device)
    per_layer = [cache.index_select(1, index) for cache in kv_caches]
    return torch.stack(per_layer, dim=0).permute(2, 0, 1, 3, 4, 5).to("cpu").contiguous()


def scatter_device_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor
) -> None:
    """Inverse of `gather_device_blocks`: `data[i]` into device block `block_ids[i]`."""
    device = kv_caches[0].device
    index = torch.tensor(block_ids, dtype=torch.int64, device=device)
    data = data.to(device, non_blocking=True)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[:, layer].transpose(0, 1))


def block_to_bytes(block: torch.Tensor) -> bytes:
    """One block's payload for a file: its values in C order."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def block_from_bytes(payload: bytes, layout: KVBlockLayout, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(layout.shape)
