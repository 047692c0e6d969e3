"""AppendBuffer: the torch_dist writer's object buffer (cloudckpt/formats/dcp/append_buffer.py)."""

from __future__ import annotations

import io

import torch

from cloudckpt.formats.dcp.append_buffer import AppendBuffer


def test_torch_save_into_a_reserved_buffer_fills_it_without_growing() -> None:
    tensor = torch.arange(100_000, dtype=torch.float32)
    expected = io.BytesIO()
    torch.save(tensor, expected)
    buffer = AppendBuffer()
    buffer.reserve(tensor.numel() * 4 + 2048)
    capacity = buffer.capacity
    torch.save(tensor, buffer)  # type: ignore[arg-type]
    assert buffer.capacity == capacity and buffer.tell() == len(expected.getvalue())
    assert bytes(buffer.view()) == expected.getvalue()
    assert torch.equal(torch.load(io.BytesIO(buffer.view()), weights_only=True), tensor)


def test_writes_past_the_capacity_grow_it_and_keep_every_byte() -> None:
    buffer = AppendBuffer(4)
    pieces = [b"abc", memoryview(b"defgh"), bytearray(b"ij"), torch.arange(3).numpy().data]
    for piece in pieces:
        buffer.write(piece)
    tail = torch.arange(3).numpy().tobytes()
    assert bytes(buffer.view()) == b"abcdefghij" + tail and buffer.tell() == 10 + len(tail)
    assert buffer.capacity >= buffer.tell() and bytes(buffer.view(3, 8)) == b"defgh"
