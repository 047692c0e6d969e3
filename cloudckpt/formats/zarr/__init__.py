"""The zarr engine: one zarr v2 array per ShardedTensor key, as Megatron-Core 0.15 wrote it."""
