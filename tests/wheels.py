"""Release artifacts for tests: a source tree (the working tree or a past commit) built into a wheel with `python -m
build` (no isolation: this environment's setuptools, no index needed), and a clean venv holding only that wheel.

The venv gets the wheel with --no-deps and sees this environment's site-packages only as a plain path after its own
(a `.pth` line: no editable installs, whose finders live in `.pth` files that a plain path does not run), so what
it imports of kv-rendezvous is the wheel's. Run its commands outside the repository with `isolated_env()`.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
PREVIOUS_RELEASE_ENV = "RENDEZVOUS_PREVIOUS_RELEASE"


def _load_release_commit() -> ModuleType:
    """scripts/release_commit.py, which `make breaking` runs, as a module."""
    spec = importlib.util.spec_from_file_location("release_commit", REPO / "scripts" / "release_commit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release_commit = _load_release_commit()


def previous_release() -> str | None:
    """The git revision of the release before the working tree: RENDEZVOUS_PREVIOUS_RELEASE when set, else the
    commit CHANGELOG.md names for its newest release; None before the first release."""
    override = os.environ.get(PREVIOUS_RELEASE_ENV, "").strip()
    if override:
        return override
    found = release_commit.release_commit((REPO / "CHANGELOG.md").read_text(encoding="utf-8"))
    return None if found is None else str(found[1])


def isolated_env() -> dict[str, str]:
    """The environment for a clean venv's commands: nothing on PYTHONPATH (run them outside the repository)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}


def run(*args: str | Path, cwd: Path | None = None) -> str:
    """Run a command (isolated when cwd is given); its stdout, or an AssertionError with its output."""
    env = None if cwd is None else isolated_env()
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def export_working_tree(dest: Path) -> Path:
    """The working tree's tracked and unignored files, copied into dest (the build writes into its source);
    symlinks stay symlinks, as in a clone (rendezvous/clients and rendezvous/connector are)."""
    files = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, files):
        src = REPO / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            (dest / name).symlink_to(os.readlink(src))
        elif src.is_file():
            (dest / name).write_bytes(src.read_bytes())
    return dest


def export_commit(rev: str, dest: Path) -> Path:
    """The tree of commit rev (any git revision) written into dest (`git archive`)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, capture_output=True, check=False)
    assert archive.returncode == 0, f"git archive {rev} failed: {archive.stderr.decode(errors='replace')}"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def build(source: Path, outdir: Path, *, wheel_only: bool = False) -> Path:
    """`python -m build` of source into outdir (the sdist and, from it, the wheel; or the wheel alone)."""
    run(
        sys.executable,
        "-m",
        "build",
        "--no-isolation",
        *(["--wheel"] if wheel_only else []),
        "--outdir",
        outdir,
        source,
    )
    return outdir


def wheel_venv(wheel: Path, path: Path) -> Path:
    """A fresh venv at path holding only wheel, this environment's site-packages visible after its own."""
    run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=path).strip()
    (Path(site) / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=path)
    return path
