"""scripts/release_commit.py: the newest release's commit, read from CHANGELOG.md's `Release commit:` line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.wheels import release_commit

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "release_commit.py"
OLD = "a" * 40
NEW = "0123456789abcdef0123456789abcdef01234567"


def _changelog(*sections: str) -> str:
    return "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n### Changed\n- something\n\n" + "\n".join(sections)


def test_before_any_release_there_is_no_commit() -> None:
    assert release_commit.release_commit(_changelog()) is None


def test_the_newest_release_section_names_the_commit() -> None:
    text = _changelog(
        f"## [0.2.0] - 2027-01-10\n\nRelease commit: {NEW}\n\n### Added\n- x\n\n",
        f"## [0.1.0] - 2026-12-02\n\nRelease commit: {OLD}\n",
    )
    assert release_commit.release_commit(text) == ("0.2.0", NEW)


@pytest.mark.parametrize(
    "line", [f"- Release commit: `{NEW}`", f"* Release commit: {NEW}  ", f"Release commit:`{NEW}`"]
)
def test_a_list_item_or_backticks_are_read_too(line: str) -> None:
    assert release_commit.release_commit(_changelog(f"## [0.1.0]\n\n{line}\n")) == ("0.1.0", NEW)


def test_a_release_commit_line_under_unreleased_is_not_a_release() -> None:
    text = f"# Changelog\n\n## [Unreleased]\n\nRelease commit: {NEW}\n"
    assert release_commit.release_commit(text) is None


def test_a_newest_release_without_its_line_is_an_error_not_the_older_release() -> None:
    text = _changelog("## [0.2.0]\n\n### Added\n- x\n\n", f"## [0.1.0]\n\nRelease commit: {OLD}\n")
    with pytest.raises(release_commit.ChangelogError, match=r"\[0\.2\.0\] section has no 'Release commit"):
        release_commit.release_commit(text)


@pytest.mark.parametrize("sha", [NEW[:12], NEW.upper(), NEW + "0", "v0.1.0"])
def test_a_release_commit_that_is_not_a_full_sha_is_an_error(sha: str) -> None:
    with pytest.raises(release_commit.ChangelogError, match="not 40 lowercase hex digits"):
        release_commit.release_commit(_changelog(f"## [0.1.0]\n\nRelease commit: {sha}\n"))


def test_two_release_commit_lines_in_one_section_are_an_error() -> None:
    text = _changelog(f"## [0.1.0]\n\nRelease commit: {NEW}\nRelease commit: {OLD}\n")
    with pytest.raises(release_commit.ChangelogError, match="has 2 'Release commit"):
        release_commit.release_commit(text)


def _script(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)


def test_the_script_prints_the_commit_or_nothing_and_fails_with_the_reason(tmp_path: Path) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(_changelog(f"## [0.1.0]\n\nRelease commit: {NEW}\n"))
    assert (_script(changelog).returncode, _script(changelog).stdout) == (0, f"{NEW}\n")
    changelog.write_text(_changelog())
    assert (_script(changelog).returncode, _script(changelog).stdout) == (0, "")
    changelog.write_text(_changelog("## [0.1.0]\n"))
    failed = _script(changelog)
    assert failed.returncode == 1 and "[0.1.0] section has no" in failed.stderr and not failed.stdout


def test_the_repositorys_changelog_parses() -> None:
    assert subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, timeout=60).returncode == 0
