"""The Redis store's Lua scripts: named arguments from one table, and shipped in a (non-editable) install."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest

from rendezvous.store.redis.scripts import SCRIPTS, SIGNATURES, Group, Script, Signature

ROOT = Path(__file__).resolve().parents[2]
LUA_FILES = sorted(
    p.name for p in resources.files("rendezvous.store.redis.scripts").iterdir() if p.name.endswith(".lua")
)


def test_every_script_has_its_lua_file_and_every_file_is_used() -> None:
    helpers = {"_" + h + ".lua" for s in SIGNATURES.values() for h in s.helpers}
    assert sorted({name + ".lua" for name in SIGNATURES} | helpers) == LUA_FILES


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_a_script_uses_every_argument_it_declares(name: str) -> None:
    body = resources.files("rendezvous.store.redis.scripts").joinpath(name + ".lua").read_text()
    signature = SIGNATURES[name]
    for arg in (*signature.args, *(g.name for g in signature.groups)):
        assert re.search(rf"\b{arg}\b", body), f"{name}.lua never uses its argument {arg}"


def test_named_arguments_are_laid_out_as_the_generated_header_reads_them() -> None:
    script = Script.load(
        "read_transfer", Signature(("a", "b"), (Group("pairs", ("x", "y")), Group("ids", ("id",))), ())
    )
    assert "local a = ARGV[2]\nlocal b = ARGV[3]\n" in script.source
    assert "pairs[j] = {x = ARGV[i], y = ARGV[i + 1]}" in script.source and "ids[j] = ARGV[i]" in script.source
    argv = script.argv("{p}:", b=2, a=1, pairs=[("x1", "y1"), ("x2", "y2")], ids=["i1"])
    assert argv == ["{p}:", 1, 2, 2, 1, "x1", "y1", "x2", "y2", "i1"]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'ids'"):
        script.argv("{p}:", a=1, b=2, pairs=[])
    with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
        script.argv("{p}:", a=1, b=2, pairs=[], ids=[], c=3)
    with pytest.raises(ValueError, match="'class' cannot be an argument name"):
        Script.load("read_transfer", Signature(("class",)))


def test_a_non_editable_install_ships_the_scripts(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("rendezvous", "clients", "connector"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)]
    subprocess.run(build, check=True, timeout=110)
    (wheel,) = wheels.glob("*.whl")
    shipped = {
        Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("rendezvous/store/redis/scripts/")
    }
    assert set(LUA_FILES) <= shipped

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=60)
    probe = "import rendezvous.store.redis.scripts as s; print(s.__file__); print(len(s.SCRIPTS))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out == [str(site / "rendezvous/store/redis/scripts/__init__.py"), str(len(SCRIPTS))]
