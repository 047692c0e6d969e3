"""HostCopies: the torch_dist writer's device-to-host buffers, reused across saves
(cloudckpt/strategies/_host_copies.py). Pinned buffers need CUDA; the reuse and bounds
logic is the same with unpinned ones, tested here."""

from __future__ import annotations

import torch

from cloudckpt.strategies._host_copies import HostCopies, to_host


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
