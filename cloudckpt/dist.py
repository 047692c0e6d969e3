"""The seam between cloudckpt and ``torch.distributed``.

Every collective cloudckpt needs goes through this module, and each one also works
when no process group is initialised: then the world is one rank (rank 0) and the
collectives are identities. Object collectives use the default group unless one
is passed.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.distributed as torch_dist

from cloudckpt.errors import DistributedCheckpointError

logger = logging.getLogger(__name__)

ReduceOp = Literal["min", "max", "sum"]
_REDUCE_OPS = {
    "min": torch_dist.ReduceOp.MIN,
    "max": torch_dist.ReduceOp.MAX,
    "sum": torch_dist.ReduceOp.SUM,
}


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return torch_dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return torch_dist.get_world_size(group) if is_distributed() else 1


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group``; a no-op in a world of one."""
    if is_distributed():
        torch_dist.barrier(group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Gather one picklable object from every rank, indexed by rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    torch_dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Return ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_reduce_int(value: int, op: ReduceOp = "sum", group: Any = None) -> int:
    """Reduce one integer across ranks with ``op`` ("min", "max" or "sum")."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch_dist.all_reduce(t, op=_REDUCE_OPS[op], group=group)
    return int(t.item())


def raise_if_any_rank_failed(error: BaseException | None, what: str, group: Any = None) -> None:
    """Collective: every rank learns whether any rank failed ``what``, and raises if so.

    Each rank passes the exception it caught (or None). If any rank failed, every rank
    raises :class:`DistributedCheckpointError` naming the failed ranks and their errors,
    so no rank is left waiting in a later collective. The local exception is chained.
    """
    local = None if error is None else f"{type(error).__name__}: {error}"
    failures = {r: msg for r, msg in enumerate(all_gather_object(local, group)) if msg is not None}
    if not failures:
        return
    lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
    message = f"{what} failed on {len(failures)} rank(s): {lines}"
    if error is None:
        raise DistributedCheckpointError(message, failures)
    if get_world_size(group) == 1:
        raise error
    raise DistributedCheckpointError(message, failures) from error


Transfer = tuple[int, int, torch.Tensor]  # (peer rank, tag, tensor)


def _p2p_device(group: Any = None) -> torch.device:
    """Device point-to-point transfers must use: CUDA under NCCL, else CPU."""
    if torch_dist.get_backend(group) == "nccl":  # pragma: no cover - needs GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_tensors(sends: list[Transfer], recvs: list[Transfer], group: Any = None) -> None:
    """Send and receive tensors point-to-point; returns when all transfers are done.

    Each transfer is ``(peer, tag, tensor)``; a send to rank B with tag t matches B's
    receive from this rank with tag t. Received data lands in the given tensors (CPU
    tensors are staged through the GPU when the group uses NCCL). Tensors travel as
    raw bytes, so every dtype (bfloat16, bool) works on every backend.
    """
    if not sends and not recvs:
        return
    device = _p2p_device(group)
    pending: list[Any] = []
    for peer, tag, tensor in sends:
        payload = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        pending.append(torch_dist.isend(payload, peer, group=group, tag=tag))
    staged = []
    for peer, tag, tensor in recvs:
        buffer = torch.empty(
            tensor.numel() * tensor.element_size(), dtype=torch.uint8, device=device
        )
        staged.append((buffer, tensor))
        pending.append(torch_dist.irecv(buffer, peer, group=group, tag=tag))
    for work in pending:
        if work is not None:  # None only for a rank outside ``group``
            work.wait()
    for buffer, tensor in staged:
        tensor.reshape(-1).view(torch.uint8).copy_(buffer)
