"""Shared fixtures: a persistent pool of gloo ranks for multi-process tests; markers.

Markers set here from what a test uses, so that ``-m`` selects by the servers and
processes a test needs:

* ``s3`` / ``gcs``: the test runs against an S3 / GCS server (one of the object-store
  cases of ``tests/fixtures_object_stores.py`` is among its parameters);
* ``multirank``: it uses ``rank_pool`` (tests that launch ranks themselves carry the
  marker in their module);
* ``compat``: it needs a Megatron-Core environment (``mcore15`` / ``mcore19``).

The terminal summary ends with the time spent in each test file (setup, call and
teardown of its tests, module fixtures included), to keep the suite's budget in view.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest

from cloudckpt.launch import RankPool

pytest_plugins = ["tests.fixtures_object_stores"]

WORLD_SIZE = 4
MULTIRANK_FIXTURES = {"rank_pool"}
_FILE_SECONDS: defaultdict[str, float] = defaultdict(float)
_STORE_OUTCOMES: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
STORE_PROPERTY = "object_store"
COMPAT_FIXTURES = {"mcore15", "mcore19"}


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Four real processes joined in one gloo group, reused by every multi-rank test."""
    pool = RankPool(WORLD_SIZE, timeout_s=120)
    try:
        yield pool
    finally:
        pool.close()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # imported here: the plugin module is imported (and assert-rewritten) by pytest_plugins
    from tests.fixtures_object_stores import GS_CASES, S3_CASES, store_cases_of  # noqa: PLC0415

    for item in items:
        cases = store_cases_of(item)
        # reports carry user properties to the xdist controller, for the summary per server
        item.user_properties += [(STORE_PROPERTY, case) for case in sorted(cases)]
        if cases & set(S3_CASES):
            item.add_marker(pytest.mark.s3)
        if cases & set(GS_CASES):
            item.add_marker(pytest.mark.gcs)
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & MULTIRANK_FIXTURES:
            item.add_marker(pytest.mark.multirank)
        if fixtures & COMPAT_FIXTURES:
            item.add_marker(pytest.mark.compat)
    # the longest files first (a stable sort: the order within a file stays), so that
    # with --dist loadfile no worker starts a long file while the others run out of work
    items.sort(key=lambda item: _slow_rank(item.path.name))


SLOW_FILES = (
    "test_megatron_dropin.py",
    "test_demo.py",
    "test_bounded_failure.py",
    "test_tracker.py",
    "test_dcp_plugin.py",
    "test_deploy_resume.py",
    "test_commit_race.py",
    "test_megatron_compat.py",
)
"""The suite's longest files, longest first (100-230 s each in a full run, 2 workers)."""


def _slow_rank(name: str) -> int:
    return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # with pytest-xdist, the controller sees every worker's reports here
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration
    if report.when == "call" or report.outcome != "passed":
        for name, case in report.user_properties:
            if name == STORE_PROPERTY:
                _STORE_OUTCOMES[case][report.outcome] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _STORE_OUTCOMES:
        terminalreporter.section("tests per object-store server")
        for case, outcomes in sorted(_STORE_OUTCOMES.items()):
            counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
            terminalreporter.write_line(f"{case:14} {counts}")
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(f"time per test file ({total:.0f} s in all, over all workers)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
