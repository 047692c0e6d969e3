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
