"""Checkpoint formats, one package per engine: :mod:`cloudckpt.formats.dcp` (PyTorch DCP,
Megatron-Core's torch_dist) and :mod:`cloudckpt.formats.zarr` (Megatron-Core 0.15's zarr)."""
