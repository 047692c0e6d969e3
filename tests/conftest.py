"""Shared fixtures: a persistent pool of gloo ranks for multi-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cloudckpt.launch import RankPool

pytest_plugins = ["tests.fixtures_object_stores"]

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Four real processes joined in one gloo group, reused by every multi-rank test."""
    pool = RankPool(WORLD_SIZE, timeout_s=120)
    try:
        yield pool
    finally:
        pool.close()
