"""The previous release, installed: built from its release commit (tests/wheels.py), once per session."""

from pathlib import Path

import pytest

from tests.ci import ci
from tests.redis_fixtures import redis_url
from tests.wheels import PREVIOUS_RELEASE_ENV, REPO, build, export_commit, previous_release, run, wheel_venv

__all__ = ["previous_release_venv", "redis_url"]


@pytest.fixture(scope="session")
def previous_release_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the previous release's wheel, built from its commit's tree.

    The release is the one CHANGELOG.md names (scripts/release_commit.py) or RENDEZVOUS_PREVIOUS_RELEASE. Before the
    first release neither exists: outside CI that skips; in CI it fails, so that CI never goes green without the
    mixed-version test.
    """
    rev = previous_release()
    if rev is None:
        why = f"no release in CHANGELOG.md yet and {PREVIOUS_RELEASE_ENV} is not set"
        if ci():
            pytest.fail(f"the mixed-version test must run in CI, but {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("previous-release")
    commit = run("git", "rev-parse", "--verify", f"{rev}^{{commit}}", cwd=REPO).strip()
    dist = build(export_commit(commit, root / "source"), root / "dist", wheel_only=True)
    (wheel,) = dist.glob("*.whl")
    return wheel_venv(wheel, root / "venv")
