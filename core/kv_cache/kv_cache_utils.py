"""KV cache block metadata and the LRU free-block queue (block hashes: `common.block_hash`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType

from core_engine.common.block_hash import BlockHash

# A block hash followed by its KV cache group id: each group of a hybrid model holds its own
# copy of a prefix's KV, so each group has its own entries in the pool's one hash map.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(
    block_hash: BlockHash, kv_cache_group_id: int
) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + kv_cache_group_id.to_bytes(4, "big"))


def get_group_id(block_hash_with_group_id: BlockHashWithGroupId) -> int:
    return int.from_bytes(block_hash_with_group_id[-4:], "big")


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block.

    Invariants (null block excepted): `ref_cnt == 0` iff the block sits in the free queue;
    `block_hash is not None` iff the block is full and registered in the pool's hash map.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a hash")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None})"
        )


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks, in eviction order.

    The head is the least recently freed block (evicted first); freed blocks go to the tail.
    `remove` is O(1) because each block carries its own links. Sentinel head and tail nodes
    keep every operation free of edge cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        previous = self.fake_free_list_head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks from head (next evicted) to tail."""
        blocks = []
        node = self.fake_free_list_head.next_free_block
        while node is not None and node is not self.fake_free_list_tail:
            blocks.append(node)
            node = node.next_free_block
        return blocks
