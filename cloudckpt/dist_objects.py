"""Object collectives whose every wait is bounded (used by :mod:`cloudckpt.dist`).

``torch.distributed``'s object collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``scatter_object_list``) block inside the backend: a peer
that dies or freezes there, after it checked in at cloudckpt's barrier
(:func:`cloudckpt.dist_guard.check_in`), leaves this rank waiting for the process
group's own timeout. These do the same with asynchronous tensor collectives
(``async_op=True``) awaited by :func:`cloudckpt.dist_wait.await_works`, which watches
the peers' heartbeats meanwhile. Only ranks of one job exchange them.

An all-gather and a gather send pickles in two rounds at most. The first, an
all-gather, carries a fixed *slot* per rank: the pickle's size and its first bytes;
the second, only when some pickle did not fit its slot, the remainders padded to the
longest. Most of cloudckpt's collectives carry a few bytes (agreements, digests) and
so cost one backend collective instead of two (sizes, then bytes): with gloo among 4
ranks on 2 cores, an all-gather costs about 5 ms. A broadcast and a scatter still
send the sizes first (see :func:`scatter_objects`). The slot
shrinks as the group grows (:func:`slot_bytes`), so a round-one all-gather moves at
most 256 KiB into each rank.

Ranks (``src``, ``dst``) are global ranks, as in ``torch.distributed``. Every function
is a collective of ``group`` and needs an initialised process group.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from cloudckpt.dist_wait import await_works

__all__ = ["all_gather_objects", "broadcast_object", "gather_objects", "scatter_objects"]


def device_of(group: Any = None) -> torch.device:
    """Where the backend's tensors must live: CUDA under NCCL, else CPU."""
    if torch_dist.get_backend(group) == "nccl":  # pragma: no cover - needs GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_HEADER = 8  # bytes: the pickle's size (int64)
_ROUND_ONE_BYTES = 1 << 18  # what a round-one all-gather may move into each rank
_MAX_SLOT = 1 << 16
_MIN_SLOT = 64


def slot_bytes(world: int) -> int:
    """Bytes of one object's round-one slot in a group of ``world`` ranks (header
    included): 64 KiB up to 4 ranks (an all-gather of 64 KiB slots among 4 gloo ranks
    took no longer than one of 4 KiB), then 256 KiB / ``world``, down to 64 bytes."""
    return max(_MIN_SLOT, min(_MAX_SLOT, _ROUND_ONE_BYTES // max(world, 1)))


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _slot(data: bytes, slot: int) -> torch.Tensor:
    """Round one's slot of ``data``: its size (a header), then its first bytes."""
    out = bytearray(slot)
    out[:_HEADER] = np.array([len(data)], dtype="<i8").tobytes()
    inline = data[: slot - _HEADER]
    out[_HEADER : _HEADER + len(inline)] = inline
    return torch.frombuffer(out, dtype=torch.uint8)


def _size(slot: np.ndarray) -> int:
    """The size of the pickle whose round-one slot is ``slot``."""
    return int(np.frombuffer(slot[:_HEADER].tobytes(), dtype="<i8")[0])


def _rest(data: bytes, slot: int, longest: int) -> torch.Tensor:
    """The bytes of ``data`` past its slot, padded to ``longest``."""
    return _padded(data[slot - _HEADER :], longest)


def _padded(data: bytes, size: int) -> torch.Tensor:
    out = bytearray(size)
    out[: len(data)] = data
    return torch.frombuffer(out, dtype=torch.uint8)


def _rest_len(size: int, slot: int) -> int:
    return max(0, size - (slot - _HEADER))


def _unpickled(slot: np.ndarray, size: int, rest: np.ndarray | None) -> Any:
    """The object whose pickle (``size`` bytes) starts in ``slot`` and goes on in ``rest``."""
    inline = min(size, len(slot) - _HEADER)
    data = slot[_HEADER : _HEADER + inline].tobytes()
    if size > inline:
        assert rest is not None
        data += rest[: size - inline].tobytes()
    return pickle.loads(data)


def _host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [t.cpu().numpy() for t in tensors]


def _world(group: Any) -> int:
    return torch_dist.get_world_size(group)


def all_gather_objects(what: str, obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, indexed by group rank, on every rank."""
    device = device_of(group)
    data, world = _pickled(obj), _world(group)
    slot = slot_bytes(world)
    slots = [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(world)]
    mine = _slot(data, slot).to(device)
    await_works(what, [torch_dist.all_gather(slots, mine, group=group, async_op=True)], group)
    heads = _host(slots)
    sizes = [_size(h) for h in heads]
    longest = max(_rest_len(size, slot) for size in sizes)
    rests: list[np.ndarray | None] = [None] * world
    if longest:
        out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
        work = torch_dist.all_gather(
            out, _rest(data, slot, longest).to(device), group=group, async_op=True
        )
        await_works(what, [work], group)
        rests = list(_host(out))
    return [_unpickled(h, n, r) for h, n, r in zip(heads, sizes, rests, strict=True)]


def gather_objects(what: str, obj: Any, dst: int, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj``, indexed by group rank, on ``dst``; None elsewhere.

    Round one is an all-gather of the slots (every rank learns whether a second round
    is needed); round two, when one is, gathers the remainders on ``dst`` only."""
    device = device_of(group)
    data, world = _pickled(obj), _world(group)
    slot = slot_bytes(world)
    slots = [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(world)]
    mine = _slot(data, slot).to(device)
    await_works(what, [torch_dist.all_gather(slots, mine, group=group, async_op=True)], group)
    on_dst = torch_dist.get_rank() == dst
    heads = _host(slots)
    sizes = [_size(h) for h in heads]
    longest = max(_rest_len(size, slot) for size in sizes)
    rests: list[np.ndarray | None] = [None] * world
    if longest:
        # receive buffers on ``dst`` only: the other ranks send and receive nothing
        out = (
            [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
            if on_dst
            else None
        )
        rest = _rest(data, slot, longest).to(device)
        work = torch_dist.gather(rest, out, dst=dst, group=group, async_op=True)
        await_works(what, [work], group)
        if out is not None:
            rests = list(_host(out))
    if not on_dst:
        return None
    return [_unpickled(h, n, r) for h, n, r in zip(heads, sizes, rests, strict=True)]


def broadcast_object(what: str, obj: Any, src: int, group: Any = None) -> Any:
    """``src``'s ``obj`` on every rank (``obj`` itself on ``src``, unpickled elsewhere).

    Two rounds, size then pickle, as a scatter (see :func:`scatter_objects`): with one,
    a rank served before a lost peer (gloo's broadcast is a tree) would not learn of
    the loss."""
    device = device_of(group)
    on_src = torch_dist.get_rank() == src
    data = _pickled(obj) if on_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    await_works(what, [torch_dist.broadcast(size, src=src, group=group, async_op=True)], group)
    buffer = (
        _padded(data, len(data)).to(device)
        if on_src
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    await_works(what, [torch_dist.broadcast(buffer, src=src, group=group, async_op=True)], group)
    if on_src:  # as torch.distributed's broadcast_object_list: src keeps its own object
        return obj
    return pickle.loads(buffer.cpu().numpy().tobytes())


def scatter_objects(what: str, objs: Sequence[Any] | None, src: int, group: Any = None) -> Any:
    """Element ``i`` of ``src``'s ``objs`` (one per group rank) on group rank ``i``.

    Still two rounds, sizes (broadcast), then the pickles (scatter): with one round (a
    broadcast of every slot), a rank that gets its part before a lost peer gets its own
    would go on without learning of the loss (gloo's broadcast is a tree). A save
    scatters once (PyTorch DCP's plans), and plans outgrow a slot anyway."""
    device = device_of(group)
    world = _world(group)
    on_src = torch_dist.get_rank() == src
    datas = [_pickled(o) for o in objs] if on_src and objs is not None else []
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    if on_src:
        if len(datas) != world:
            raise ValueError(f"{what}: {len(datas)} objects to scatter over {world} ranks")
        sizes.copy_(torch.tensor([len(d) for d in datas], dtype=torch.int64))
    await_works(what, [torch_dist.broadcast(sizes, src=src, group=group, async_op=True)], group)
    longest = int(sizes.max().item())
    out = torch.empty(longest, dtype=torch.uint8, device=device)
    chunks = [_padded(d, longest).to(device) for d in datas] if on_src else None
    work = torch_dist.scatter(out, chunks, src=src, group=group, async_op=True)
    await_works(what, [work], group)
    size = int(sizes[torch_dist.get_rank(group)].item())
    return pickle.loads(out[:size].cpu().numpy().tobytes())
