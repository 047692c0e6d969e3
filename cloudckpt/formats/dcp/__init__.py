"""The torch_dist engine: PyTorch DCP's format (``.distcp`` objects and ``.metadata``),
written and read through :class:`~cloudckpt.storage.CheckpointStorage`."""
