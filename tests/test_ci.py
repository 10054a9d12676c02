"""tests/ci.py: under CI a skipped redis, nixl, vllm or netns test fails, and hypothesis runs its `ci` profile.

Each check runs pytest or Python in a subprocess, with and without CI in the environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CASES = """
import pytest

@pytest.mark.redis
def test_redis_skips():
    pytest.skip("no redis-server")

@pytest.mark.nixl
@pytest.mark.skipif(True, reason="no nixl")
def test_nixl_skipif():
    pass

def test_plain_skip():
    pytest.skip("not a suite CI must run")

@pytest.mark.vllm
@pytest.mark.xfail(reason="expected", strict=True)
def test_vllm_xfail():
    raise AssertionError

@pytest.mark.redis
def test_redis_runs():
    pass

@pytest.mark.netns
def test_netns_skips():
    pytest.skip("cannot make network namespaces")
"""


def _env(ci: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    env["PYTHONPATH"] = str(REPO)
    if ci is not None:
        env["CI"] = ci
    return env


def run_pytest(tmp_path: Path, ci: str | None, *args: str) -> tuple[int, str]:
    """Exit status and output of pytest (with tests/ci.py, without other plugins) over the cases above."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    redis: r\n    nixl: n\n    vllm: v\n    netns: s\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "whole").mkdir(exist_ok=True)
    (tmp_path / "whole" / "conftest.py").write_text("import pytest\n\npytest.importorskip('no_such_module_here')\n")
    (tmp_path / "whole" / "test_whole.py").write_text("def test_never_collected():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-p", "tests.ci", "-p", "no:cacheprovider", "-rA", "-q"]
    done = subprocess.run(
        [*command, "--continue-on-collection-errors", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**_env(ci), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        timeout=120,
    )
    return done.returncode, done.stdout


def test_skips_are_skips_on_a_developers_machine(tmp_path: Path) -> None:
    code, out = run_pytest(tmp_path, None)
    assert code == 0, out
    assert "1 passed, 5 skipped, 1 xfailed" in out


@pytest.mark.parametrize(("ci", "flags"), [("1", ()), ("true", ()), (None, ("--require-suites",))])
def test_under_ci_a_skipped_suite_fails(tmp_path: Path, ci: str | None, flags: tuple[str, ...]) -> None:
    code, out = run_pytest(tmp_path, ci, *flags)
    assert code == 1, out
    assert "2 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out
    assert "FAILED test_cases.py::test_redis_skips - the redis suite must run here" in out
    assert "FAILED test_cases.py::test_netns_skips - the netns suite must run here" in out
    assert "ERROR test_cases.py::test_nixl_skipif - the nixl suite must run here" in out  # skipped in its setup
    assert "ERROR whole - whole must not be skipped as a whole here" in out  # its conftest skipped it
    assert "SKIPPED [1] test_cases.py:14: not a suite CI must run" in out
    assert "XFAIL test_cases.py::test_vllm_xfail" in out  # an expected failure is not a skip


def test_ci_set_to_an_off_value_keeps_skips(tmp_path: Path) -> None:
    code, out = run_pytest(tmp_path, "0")
    assert code == 0, out
    assert "1 passed, 5 skipped, 1 xfailed" in out


@pytest.mark.parametrize(
    ("ci", "expected"), [(None, "100 200ms 150 False"), ("1", "200 None 300 True")], ids=["dev", "ci"]
)
def test_the_hypothesis_profile_follows_ci(ci: str | None, expected: str) -> None:
    code = (
        "from hypothesis import settings\n"
        "from tests.ci import examples\n"
        "s = settings()\n"
        "print(s.max_examples, s.deadline if s.deadline is None else f'{s.deadline.total_seconds() * 1000:.0f}ms',"
        " examples(150), s.derandomize)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_env(ci), timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()
