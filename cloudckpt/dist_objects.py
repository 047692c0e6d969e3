"""Object collectives whose every wait is bounded (used by :mod:`cloudckpt.dist`).

``torch.distributed``'s object collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``scatter_object_list``) block inside the backend: a peer
that dies or freezes there, after it checked in at cloudckpt's barrier
(:func:`cloudckpt.dist_guard.check_in`), leaves this rank waiting for the process
group's own timeout. These do the same with asynchronous tensor collectives
(``async_op=True``) awaited by :func:`cloudckpt.dist_guard.await_works`, which watches
the peers' heartbeats meanwhile. Objects travel as pickles padded to the longest
one: first their sizes, then the bytes. Only ranks of one job exchange them.

Ranks (``src``, ``dst``) are global ranks, as in ``torch.distributed``. Every function
is a collective of ``group`` and needs an initialised process group.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as torch_dist

from cloudckpt.dist_guard import await_works

__all__ = ["all_gather_objects", "broadcast_object", "gather_objects", "scatter_objects"]


def device_of(group: Any = None) -> torch.device:
    """Where the backend's tensors must live: CUDA under NCCL, else CPU."""
    if torch_dist.get_backend(group) == "nccl":  # pragma: no cover - needs GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor, size: int) -> Any:
    return pickle.loads(payload[:size].cpu().numpy().tobytes())


def _padded(payload: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=payload.device)
    out[: payload.numel()] = payload
    return out


def _world(group: Any) -> int:
    return torch_dist.get_world_size(group)


def _sizes(what: str, size: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's payload size, indexed by group rank."""
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(_world(group))]
    await_works(what, [torch_dist.all_gather(sizes, mine, group=group, async_op=True)], group)
    return [int(s.item()) for s in sizes]


def all_gather_objects(what: str, obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, indexed by group rank, on every rank."""
    device = device_of(group)
    payload = _encode(obj, device)
    sizes = _sizes(what, payload.numel(), group, device)
    longest = max(sizes)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    work = torch_dist.all_gather(out, _padded(payload, longest), group=group, async_op=True)
    await_works(what, [work], group)
    return [_decode(t, size) for t, size in zip(out, sizes, strict=True)]


def gather_objects(what: str, obj: Any, dst: int, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj``, indexed by group rank, on ``dst``; None elsewhere."""
    device = device_of(group)
    payload = _encode(obj, device)
    sizes = _sizes(what, payload.numel(), group, device)
    longest = max(sizes)
    on_dst = torch_dist.get_rank() == dst
    # receive buffers on ``dst`` only: the other ranks send and receive nothing
    out = (
        [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes] if on_dst else None
    )
    work = torch_dist.gather(_padded(payload, longest), out, dst=dst, group=group, async_op=True)
    await_works(what, [work], group)
    return (
        [_decode(t, size) for t, size in zip(out, sizes, strict=True)] if out is not None else None
    )


def broadcast_object(what: str, obj: Any, src: int, group: Any = None) -> Any:
    """``src``'s ``obj`` on every rank."""
    device = device_of(group)
    on_src = torch_dist.get_rank() == src
    payload = _encode(obj, device) if on_src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    await_works(what, [torch_dist.broadcast(size, src=src, group=group, async_op=True)], group)
    data = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    data = data.to(device)
    await_works(what, [torch_dist.broadcast(data, src=src, group=group, async_op=True)], group)
    return _decode(data, int(size.item()))


def scatter_objects(what: str, objs: Sequence[Any] | None, src: int, group: Any = None) -> Any:
    """Element ``i`` of ``src``'s ``objs`` (one per group rank) on group rank ``i``."""
    device = device_of(group)
    world = _world(group)
    on_src = torch_dist.get_rank() == src
    payloads = [_encode(o, device) for o in objs] if on_src and objs is not None else []
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    if payloads:
        if len(payloads) != world:
            raise ValueError(f"{what}: {len(payloads)} objects to scatter over {world} ranks")
        sizes.copy_(torch.tensor([p.numel() for p in payloads], dtype=torch.int64))
    await_works(what, [torch_dist.broadcast(sizes, src=src, group=group, async_op=True)], group)
    longest = int(sizes.max().item())
    out = torch.empty(longest, dtype=torch.uint8, device=device)
    chunks = [_padded(p, longest) for p in payloads] if on_src else None
    work = torch_dist.scatter(out, chunks, src=src, group=group, async_op=True)
    await_works(what, [work], group)
    return _decode(out, int(sizes[torch_dist.get_rank(group)].item()))
