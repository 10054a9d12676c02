"""What CI changes in the tests (pytest plugin, loaded by tests/conftest.py). CI is on when the environment sets
CI (to anything but empty, 0, false or no), as `.ci/run` does.

Required suites. Tests marked `redis`, `nixl`, `vllm` or `netns` skip where their server, package or the right to
make network namespaces is missing, so that a developer's machine runs what it can. Where the suites are required
(`--require-suites`, on by default in CI), such a skip is a failure instead: a CI machine that lost its
redis-server, NIXL, vLLM or root cannot go green by running less. So is a test module or directory skipped as a
whole (a conftest's `pytest.importorskip("nixl")`): it fails collection, whatever its tests' markers. Expected
failures (xfail) are not skips and stay as they are.

Hypothesis profiles. `dev` (the default: hypothesis' own settings, fresh random examples each run) and `ci`: a
fixed, reproducible sample, twice the examples, no deadline (a slow CI machine is no bug). Tests that set their
own number of examples scale it with `examples(n)`. HYPOTHESIS_PROFILE picks a profile explicitly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings


def ci() -> bool:
    """Whether the environment says this is CI."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


settings.register_profile("dev")
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if ci() else "dev"))


def examples(n: int) -> int:
    """n examples under the `dev` profile, scaled like the loaded profile's default (`ci`: 2n)."""
    return max(1, n * settings().max_examples // settings.get_profile("dev").max_examples)


SUITES = ("redis", "nixl", "vllm", "netns")
"""Markers of the suites CI must run (declared in pyproject.toml)."""
_required = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-suites",
        action="store_true",
        default=ci(),
        help=f"fail, instead of skipping, tests of the {', '.join(SUITES)} suites (default: on when CI is set)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _required
    _required = bool(config.getoption("require_suites"))


def _fail(report: pytest.TestReport | pytest.CollectReport, why: str) -> None:
    longrepr = report.longrepr  # a skip's is (path, line, "Skipped: reason")
    skipped = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"{why} (--require-suites, on in CI), but: {skipped}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if _required and report.skipped and not hasattr(report, "wasxfail"):
        suites = [suite for suite in SUITES if item.get_closest_marker(suite) is not None]
        if suites:
            _fail(report, f"the {' and '.join(suites)} suite must run here")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    report = yield
    if _required and report.skipped:
        _fail(report, f"{collector.nodeid or 'the session'} must not be skipped as a whole here")
    return report
