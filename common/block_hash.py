"""Chained block hashes: what the engine core keys its prefix cache by, and what a
data-parallel frontend routes by.

A block's hash covers its parent's hash, so it identifies the whole prefix up to the block's
end. The chain starts from a 16-byte seed, random per process unless `PREFIX_HASH_SEED_ENV`
holds one (32 hex digits): a frontend that launches several engine cores gives them one seed, so
it can compute the hashes its cores will cache and route a prompt to the core holding its
prefix. A random seed keeps hashes unpredictable from outside (no collisions on purpose).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any, NewType

import msgspec
import xxhash

BlockHash = NewType("BlockHash", bytes)

PREFIX_HASH_SEED_ENV = "CORE_ENGINE_PREFIX_HASH_SEED"
SEED_BYTES = 16


def seed_from_env() -> bytes:
    """The seed in PREFIX_HASH_SEED_ENV, or 16 random bytes when it is unset. ValueError
    names the variable when its text is not 32 hex digits."""
    text = os.environ.get(PREFIX_HASH_SEED_ENV, "").strip()
    if not text:
        return os.urandom(SEED_BYTES)
    try:
        seed = bytes.fromhex(text)
    except ValueError:
        seed = b""
    if len(seed) != SEED_BYTES:
        raise ValueError(
            f"{PREFIX_HASH_SEED_ENV} must be {2 * SEED_BYTES} hex digits, got {len(text)} "
            "characters that are not"
        )
    return seed


# Seed of every hash chain this process computes with a None parent.
NONE_HASH = BlockHash(seed_from_env())


def hash_block_tokens(
    parent_block_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """128-bit xxhash of (parent hash, this block's tokens, extra keys); a None parent is
    this process's NONE_HASH.

    `extra_keys` (cache salt, adapter id, ...) separates otherwise identical token blocks.
    """
    hasher = xxhash.xxh3_128()
    hasher.update(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        hasher.update(msgspec.msgpack.encode(extra_keys))
    return BlockHash(hasher.digest())


def block_extra_keys(
    start_token_index: int, cache_salt: str | None, lora_name: str | None = None
) -> tuple[object, ...] | None:
    """The extra keys of the block whose first token is at `start_token_index`: the cache salt
    and the LoRA adapter's name (as ("lora", name), so no salt can equal it), for the first
    block only. Every later block is chained from the first, so one keyed block separates the
    whole prompt from other salts and adapters and from plain prompts of the base model."""
    if start_token_index != 0:
        return None
    keys: list[object] = []
    if cache_salt is not None:
        keys.append(cache_salt)
    if lora_name is not None:
        keys.append(("lora", lora_name))
    return tuple(keys) or None


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: bytes,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """The hashes of the full blocks of `token_ids`, chained from `seed`: what an engine core
    whose NONE_HASH is `seed` computes for the same prompt, `cache_salt` and adapter."""
    hashes: list[BlockHash] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra_keys = block_extra_keys(start, cache_salt, lora_name)
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


# The chain seed of transfer hashes: fixed and public, unlike NONE_HASH, so that two engines
# (a prefill and a decode instance) agree on them without sharing a secret.
TRANSFER_HASH_SEED = b"core-engine-kvxf"


def transfer_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The hashes that name a prompt's full blocks between engines (prefill/decode
    disaggregation): equal for equal tokens, block size and salt in every process."""
    return prompt_block_hashes(token_ids, block_size, TRANSFER_HASH_SEED, cache_salt)


def compact_block_hash(block_hash: bytes) -> int:
    """A hash's first 8 bytes as an int: what cores report and routers compare (a 64-bit
    collision costs at most a routing choice, never a wrong KV)."""
    return int.from_bytes(block_hash[:8], "little")
