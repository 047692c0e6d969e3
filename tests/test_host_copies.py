"""HostCopies: the torch_dist writer's device-to-host buffers, reused across saves
(cloudckpt/formats/host_copies.py). Pinned buffers need CUDA; the reuse and bounds
logic is the same with unpinned ones, tested here."""

from __future__ import annotations

import io
import logging
import mmap

import pytest
import torch

from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.host_copies import HostCopies, Registrar, to_host


def test_buffers_are_reused_per_dtype_and_shape_and_hold_the_copy() -> None:
    copies = HostCopies(limit_bytes=1 << 20, pin=False)
    first, second = torch.arange(12.0).reshape(3, 4), torch.ones(3, 4)
    with copies.staged(first) as host:
        assert torch.equal(host, first) and host.data_ptr() != first.data_ptr()
        kept = host
    with copies.staged(second) as host:  # the next save of the same tensor: same buffer
        assert host is kept and torch.equal(host, second)
    with copies.staged(second.to(torch.bfloat16)) as other:
        assert other is not kept and other.dtype == torch.bfloat16
    assert copies.kept_bytes == 12 * 4 + 12 * 2


def test_buffers_beyond_the_limit_are_not_kept() -> None:
    copies = HostCopies(limit_bytes=100, pin=False)
    with copies.staged(torch.zeros(20)):  # 80 bytes: kept
        pass
    with copies.staged(torch.zeros(10)):  # 40 more: over the limit, freed
        pass
    assert copies.kept_bytes == 80
    copies.clear()
    assert copies.kept_bytes == 0


def test_cpu_tensors_are_serialized_as_they_are_unless_a_view() -> None:
    copies = HostCopies(pin=False)
    whole = torch.arange(10.0)
    with copies.host(whole) as host:
        assert host.data_ptr() == whole.data_ptr()  # no copy, no buffer kept
    with copies.host(whole[2:5]) as view:  # torch.save would write the whole storage
        assert view.untyped_storage().nbytes() == 12 and torch.equal(view, whole[2:5])
    assert copies.kept_bytes == 0 and to_host(whole).data_ptr() == whole.data_ptr()


def test_staged_copies_are_held_until_released_then_reused_by_the_next_save() -> None:
    copies = HostCopies(limit_bytes=1 << 20, pin=False, keep_cpu=True)
    layers = [torch.full((4, 4), float(i)) for i in range(3)]  # one shape, three tensors
    staged = copies.copies(layers)
    assert [t.data_ptr() for t in staged] != [t.data_ptr() for t in layers]
    for layer in layers:
        layer.add_(100.0)  # the training step after staging: the copies keep the old values
    assert all(torch.equal(s, torch.full((4, 4), float(i))) for i, s in enumerate(staged))
    again = copies.copies(layers)  # a save while the first still holds its copies: new ones
    assert {t.data_ptr() for t in again}.isdisjoint(t.data_ptr() for t in staged)
    assert copies.kept_bytes == 0
    copies.release(staged)
    assert copies.kept_bytes == 3 * 64
    third = copies.copies(layers)  # every kept buffer of the shape reused
    assert {t.data_ptr() for t in third} == {t.data_ptr() for t in staged}
    assert all(torch.equal(t, layer) for t, layer in zip(third, layers, strict=True))
    copies.release([torch.zeros(4, 4)])  # not one of its buffers: not kept
    assert copies.kept_bytes == 0


def test_cpu_tensors_are_staged_into_fresh_copies_by_default() -> None:
    copies = HostCopies(pin=False)
    source = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: the copy is
    (staged,) = copies.copies([source])
    assert torch.equal(staged, source) and staged.is_contiguous()
    copies.release([staged])
    assert copies.kept_bytes == 0  # a CPU-only process keeps no second copy of its state


class _RecordingRegistrar:
    """Stands in for cudaHostRegister / cudaHostUnregister (no GPU here): records calls."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, data_ptr: int, nbytes: int) -> None:
        self.calls.append(("register", data_ptr))
        if self.fail:
            raise CheckpointingException("cudaHostRegister of the test failed: error 712")
        assert data_ptr not in self.registered
        self.registered[data_ptr] = nbytes

    def unregister(self, data_ptr: int) -> None:
        self.calls.append(("unregister", data_ptr))
        del self.registered[data_ptr]

    def registrar(self) -> Registrar:
        return Registrar(register=self.register, unregister=self.unregister)


def _pinned_copies(recorder: _RecordingRegistrar, limit_bytes: int = 1 << 30) -> HostCopies:
    return HostCopies(
        limit_bytes=limit_bytes,
        pin=True,
        keep_cpu=True,
        register_min_bytes=1,
        registrar=recorder.registrar(),
    )


def test_pinned_buffers_are_their_own_pages_registered_once_for_exactly_their_size() -> None:
    recorder = _RecordingRegistrar()
    copies = _pinned_copies(recorder)
    state = [torch.rand(1000, 3), torch.rand(7).to(torch.bfloat16), torch.rand(1000, 3)]
    staged = copies.copies(state)
    for buffer, source in zip(staged, state, strict=True):
        nbytes = source.numel() * source.element_size()
        assert torch.equal(buffer, source) and buffer.data_ptr() != source.data_ptr()
        assert buffer.data_ptr() % mmap.PAGESIZE == 0  # pages of its own
        assert buffer.untyped_storage().nbytes() == nbytes  # torch.save writes only these
        assert recorder.registered[buffer.data_ptr()] == nbytes
    assert copies.registered_bytes == 2 * 12000 + 14
    copies.release(staged)
    again = copies.copies(state)  # the next save: the same buffers, no new registration
    assert {t.data_ptr() for t in again} == {t.data_ptr() for t in staged}
    assert [c for c, _ in recorder.calls] == ["register"] * 3
    saved = io.BytesIO()
    torch.save(again[1], saved)
    assert torch.equal(torch.load(io.BytesIO(saved.getvalue())), state[1])


def test_a_changed_state_drops_and_unregisters_the_buffers_of_shapes_no_longer_staged() -> None:
    recorder = _RecordingRegistrar()
    copies = _pinned_copies(recorder, limit_bytes=0)  # kept: the last staging only
    old = copies.copies([torch.zeros(64), torch.zeros(8, 8)])
    copies.release(old)
    assert copies.kept_bytes == 2 * 256  # the state once, above limit_bytes
    new = copies.copies([torch.zeros(64), torch.zeros(4, 4)])  # one shape changed
    assert new[0].data_ptr() == old[0].data_ptr()
    assert old[1].data_ptr() not in recorder.registered  # dropped and unregistered
    copies.release(new)
    assert copies.kept_bytes == 256 + 64 == copies.registered_bytes
    copies.clear()
    assert copies.kept_bytes == 0 and recorder.registered == {}
    assert recorder.calls.count(("unregister", old[0].data_ptr())) == 1


def test_a_sync_save_keeps_registered_buffers_up_to_the_limit_and_unregisters_the_rest() -> None:
    recorder = _RecordingRegistrar()
    copies = _pinned_copies(recorder, limit_bytes=100)
    with copies.staged(torch.ones(20)) as first:  # 80 bytes: kept
        assert torch.equal(first, torch.ones(20))
    with copies.staged(torch.ones(10)) as second:  # 40 more: over the limit
        ptr = second.data_ptr()
        assert ptr in recorder.registered
    assert ptr not in recorder.registered and copies.kept_bytes == 80


def test_when_registering_fails_pinned_allocation_is_used_from_then_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = _RecordingRegistrar(fail=True)
    copies = _pinned_copies(recorder)
    for _ in range(2):  # PyTorch's pinned allocator needs CUDA: it raises on this machine
        with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError):
            copies.copies([torch.zeros(16)])
    assert recorder.calls == [("register", recorder.calls[0][1])]  # tried once only
    assert [r.getMessage() for r in caplog.records if "registering" in r.getMessage()] == [
        "pinning host buffers by registering them failed (cudaHostRegister of the test "
        "failed: error 712): using PyTorch's pinned allocator from now on (its blocks are "
        "rounded up to a power of two)"
    ]
