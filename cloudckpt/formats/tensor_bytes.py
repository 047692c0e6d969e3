"""A tensor's raw bytes and back: what both formats write and read (no copy where the
memory allows)."""

from __future__ import annotations

import warnings

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor's memory (copied only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def bytes_to_tensor(raw: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as a flat tensor of ``dtype`` (read-only input is fine: callers copy out)."""
    if len(raw) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable buffer; never written to
        return torch.frombuffer(raw, dtype=dtype)
