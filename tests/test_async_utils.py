"""Tests for cloudckpt.strategies.async_utils: AsyncRequest and AsyncCallsQueue."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from cloudckpt import dist
from cloudckpt.errors import CheckpointingException, DistributedCheckpointError
from cloudckpt.launch import run_on_ranks
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest

WAIT_S = 10.0  # upper bound for waits that normally take milliseconds


def _recorder(log: list[Any], tag: Any) -> Callable[..., None]:
    def record(*args: Any, **kwargs: Any) -> None:
        log.append((tag, args, kwargs, threading.current_thread().name))

    return record


def _wait_for_thread_exit(name: str) -> None:
    """Wait until no thread called ``name`` is alive (the queue names its threads)."""
    deadline = time.monotonic() + WAIT_S
    while any(t.name == name for t in threading.enumerate()):
        assert time.monotonic() < deadline, f"thread {name} still alive"
        time.sleep(0.005)


def _gated(log: list[Any], tag: Any) -> tuple[AsyncRequest, threading.Event]:
    """A request whose async_fn blocks until the returned event is set."""
    gate = threading.Event()

    def async_fn() -> None:
        assert gate.wait(WAIT_S)
        log.append(("write", tag))

    return AsyncRequest(async_fn, (), [lambda: log.append(("finalize", tag))]), gate


# --- AsyncRequest -------------------------------------------------------------------


def test_request_defaults_and_normalisation() -> None:
    fin = (lambda: None,)
    request = AsyncRequest(print, ["a"], fin)  # type: ignore[arg-type]
    assert request.async_fn_args == ("a",)
    assert isinstance(request.finalize_fns, list) and request.finalize_fns == list(fin)
    assert request.async_fn_kwargs == {} and request.is_frozen is False
    assert AsyncRequest(None, ()).finalize_fns == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.is_frozen = True  # type: ignore[misc]


def test_request_copies_callers_finalize_list() -> None:
    given: list[Callable[[], Any]] = [lambda: None]
    request = AsyncRequest(None, (), given)
    given.append(lambda: None)
    assert len(request.finalize_fns) == 1 and request.finalize_fns is not given


def test_request_rejects_single_callable_as_finalize_fns() -> None:
    with pytest.raises(CheckpointingException, match="sequence of callables"):
        AsyncRequest(None, (), lambda: None)  # type: ignore[arg-type]


def test_add_finalize_fn_appends_in_place_and_returns_none() -> None:
    """Megatron-Core's convention: ``req.add_finalize_fn(fn)`` mutates ``req``."""
    first, second = (lambda: None), (lambda: None)
    request = AsyncRequest(None, (), [first])
    assert request.add_finalize_fn(second) is None  # type: ignore[func-returns-value]
    assert request.finalize_fns == [first, second]


def test_add_finalize_fn_ported_megatron_usage_runs_the_function() -> None:
    log: list[str] = []
    request = AsyncRequest(lambda: log.append("write"), ())
    request.add_finalize_fn(lambda: log.append("fin1"))
    request.add_finalize_fn(lambda: log.append("fin2"))
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(request)
    assert log == ["write", "fin1", "fin2"]


def test_add_finalize_fn_rejects_non_callable() -> None:
    request = AsyncRequest(None, ())
    with pytest.raises(CheckpointingException, match="needs a callable"):
        request.add_finalize_fn("not callable")  # type: ignore[arg-type]
    assert request.finalize_fns == []


def test_freeze_returns_frozen_copy_that_refuses_finalize_fns() -> None:
    first, later = (lambda: None), (lambda: None)
    request = AsyncRequest(None, (), [first])
    frozen = request.freeze()
    assert frozen.is_frozen and not request.is_frozen
    with pytest.raises(CheckpointingException, match="frozen AsyncRequest"):
        frozen.add_finalize_fn(lambda: None)
    assert frozen.finalize_fns == [first]
    request.add_finalize_fn(later)  # the unfrozen original still accepts functions
    assert request.finalize_fns == [first, later]
    assert frozen.finalize_fns == [first]  # ... without reaching the frozen copy


def test_execute_sync_runs_fn_then_finalizers_in_caller_thread() -> None:
    log: list[Any] = []
    request = AsyncRequest(
        _recorder(log, "write"),
        (1, 2),
        [_recorder(log, "f1"), _recorder(log, "f2")],
        {"k": 3},
    )
    request.execute_sync()
    me = threading.current_thread().name
    assert log == [("write", (1, 2), {"k": 3}, me), ("f1", (), {}, me), ("f2", (), {}, me)]


def test_execute_sync_without_async_fn_only_finalizes() -> None:
    log: list[Any] = []
    AsyncRequest(None, (), [lambda: log.append("fin")]).execute_sync()
    assert log == ["fin"]


def test_execute_sync_error_skips_finalizers() -> None:
    log: list[Any] = []

    def boom() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        AsyncRequest(boom, (), [lambda: log.append("fin")]).execute_sync()
    assert log == []


# --- AsyncCallsQueue, one process ---------------------------------------------------


def test_schedule_runs_async_fn_in_background_thread() -> None:
    log: list[Any] = []
    queue = AsyncCallsQueue()
    assert queue.schedule_async_request(AsyncRequest(_recorder(log, "w"), ("x",))) == 0
    assert queue.schedule_async_request(AsyncRequest(None, ())) == 1
    assert queue.get_num_unfinalized_calls() == 2
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert log == [("w", ("x",), {}, "cloudckpt-async-save-0")]
    assert queue.get_num_unfinalized_calls() == 0
    assert queue.schedule_async_request(AsyncRequest(None, ())) == 2  # indices keep growing


def test_schedule_freezes_the_request() -> None:
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(None, ()))
    assert queue._calls[0].request.is_frozen  # no public accessor
    queue.close()


def test_nonblocking_finalize_waits_for_running_call_and_keeps_order() -> None:
    log: list[Any] = []
    queue = AsyncCallsQueue()
    request0, gate0 = _gated(log, 0)
    queue.schedule_async_request(request0)
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: log.append(("finalize", 1))]))
    assert queue.maybe_finalize_async_calls() == []  # call 0 still runs; 1 must wait for it
    assert queue.get_num_unfinalized_calls() == 2 and log == []
    gate0.set()
    _wait_for_thread_exit("cloudckpt-async-save-0")
    assert queue.maybe_finalize_async_calls() == [0, 1]
    assert log == [("write", 0), ("finalize", 0), ("finalize", 1)]


def test_blocking_finalize_waits_for_all_calls() -> None:
    log: list[Any] = []
    queue = AsyncCallsQueue()
    request, gate = _gated(log, 0)
    queue.schedule_async_request(request)
    threading.Timer(0.05, gate.set).start()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert log == [("write", 0), ("finalize", 0)]


def test_finalize_fns_run_in_callers_thread_in_order() -> None:
    threads: list[str] = []
    queue = AsyncCallsQueue()

    def recorder(i: int) -> Callable[[], None]:
        return lambda: threads.append(f"{i}:{threading.current_thread().name}")

    record = [recorder(i) for i in range(3)]
    queue.schedule_async_request(AsyncRequest(lambda: None, (), record))
    queue.close()
    me = threading.current_thread().name
    assert threads == [f"0:{me}", f"1:{me}", f"2:{me}"]


def test_async_fn_error_reraised_with_call_index_and_later_calls_kept() -> None:
    log: list[Any] = []
    original = RuntimeError("503 Slow Down")

    def fail() -> None:
        raise original

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: log.append(0)]))
    queue.schedule_async_request(AsyncRequest(fail, (), [lambda: log.append(1)]))
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: log.append(2)]))
    with pytest.raises(CheckpointingException, match=r"call 1 failed: RuntimeError: 503") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert info.value.__cause__ is original
    assert log == [0]  # call 0 finalized before the failure, call 1's finalizer skipped
    assert queue.get_num_unfinalized_calls() == 1
    assert queue.maybe_finalize_async_calls() == [2] and log == [0, 2]


def test_finalize_fn_error_names_call_index() -> None:
    def bad_finalize() -> None:
        raise KeyError("metadata")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(None, (), [bad_finalize]))
    with pytest.raises(CheckpointingException, match="finalization of async checkpoint call 0"):
        queue.close()
    assert queue.get_num_unfinalized_calls() == 0


def test_empty_queue_finalizes_nothing() -> None:
    queue = AsyncCallsQueue()
    assert queue.maybe_finalize_async_calls() == []
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == []


def test_close_abort_drops_calls_without_finalizing() -> None:
    log: list[Any] = []
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        AsyncRequest(lambda: log.append("write"), (), [lambda: log.append("fin")])
    )
    queue.close(abort=True)
    assert log == ["write"] and queue.get_num_unfinalized_calls() == 0


def test_context_manager_finalizes_on_clean_exit() -> None:
    log: list[Any] = []
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(AsyncRequest(None, (), [lambda: log.append("fin")]))
        assert log == []
    assert log == ["fin"]


def test_context_manager_drops_calls_on_exception() -> None:
    log: list[Any] = []
    queue = AsyncCallsQueue()
    with pytest.raises(ZeroDivisionError), queue:
        queue.schedule_async_request(AsyncRequest(None, (), [lambda: log.append("fin")]))
        1 / 0
    assert log == [] and queue.get_num_unfinalized_calls() == 0


def test_collective_agreement_only_with_process_group_and_without_no_dist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drive the agreement through the dist seam: other ranks report fewer done calls."""
    reduces: list[tuple[int, str]] = []

    def fake_all_reduce(value: int, op: str = "sum", group: Any = None) -> int:
        reduces.append((value, op))
        return 0  # another rank has finished nothing yet

    monkeypatch.setattr(dist, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "all_reduce_int", fake_all_reduce)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(None, ()))
    assert queue.maybe_finalize_async_calls() == []  # done here, not on "the other rank"
    assert reduces == [(1, "min"), (0, "min")]
    assert queue.maybe_finalize_async_calls(no_dist=True) == [0]  # local decision
    assert len(reduces) == 2


# --- AsyncCallsQueue, two real ranks ------------------------------------------------


def _two_rank_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Run on each gloo rank; returns what each rank observed."""
    seen: dict[str, Any] = {}
    queue = AsyncCallsQueue()
    # Scenario 1: rank 1's write is held back until after the first check.
    log: list[Any] = []
    request, gate = _gated(log, rank)
    queue.schedule_async_request(request)
    if rank == 0:
        gate.set()
        _wait_for_thread_exit("cloudckpt-async-save-0")  # done locally before checking
    seen["first_check"] = queue.maybe_finalize_async_calls()
    seen["finalized_after_first_check"] = list(log)
    if rank == 1:
        gate.set()
        _wait_for_thread_exit("cloudckpt-async-save-0")
    seen["second_check"] = queue.maybe_finalize_async_calls()
    seen["log"] = list(log)

    # Scenario 2: rank 1's write fails; both ranks learn it at finalization.
    def fail() -> None:
        raise OSError(f"upload failed on rank {rank}")

    queue.schedule_async_request(AsyncRequest(fail if rank == 1 else None, ()))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except DistributedCheckpointError as exc:
        seen["error"] = (str(exc), sorted(exc.failures), type(exc.__cause__).__name__)
    seen["left"] = queue.get_num_unfinalized_calls()
    return seen


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return run_on_ranks(_two_rank_scenarios, 2, timeout_s=60)


@pytest.mark.multirank
def test_late_rank_holds_back_finalization_on_all_ranks(
    two_rank_results: list[dict[str, Any]],
) -> None:
    rank0, rank1 = two_rank_results
    # Rank 0 had finished its write, but rank 1 had not: nothing finalized anywhere.
    assert rank0["first_check"] == [] and rank1["first_check"] == []
    assert rank0["finalized_after_first_check"] == [("write", 0)]
    assert rank1["finalized_after_first_check"] == []
    # Once rank 1 is done too, a non-blocking check finalizes call 0 on both.
    assert rank0["second_check"] == [0] and rank1["second_check"] == [0]
    assert rank0["log"] == [("write", 0), ("finalize", 0)]
    assert rank1["log"] == [("write", 1), ("finalize", 1)]


@pytest.mark.multirank
def test_failure_on_one_rank_raises_on_every_rank(
    two_rank_results: list[dict[str, Any]],
) -> None:
    rank0, rank1 = two_rank_results
    for seen in (rank0, rank1):
        message, failed_ranks, _ = seen["error"]
        assert "async checkpoint call 1" in message
        assert "upload failed on rank 1" in message
        assert failed_ranks == [1]
        assert seen["left"] == 0
    assert rank1["error"][2] == "OSError"  # chained to the local error where it happened
    assert rank0["error"][2] == "NoneType"
