"""KV cache metadata: `KVCacheBlock`s in a `BlockPool` with its free queue and prefix-hash map,
the `KVCacheManager` the scheduler asks for blocks (through a `KVCacheCoordinator` over one
`SingleTypeKVCacheManager` per KV cache group), the groups' specs, and the block map and cache
events the frontend reads. Block ids and hashes only: the KV memory is the workers'."""
