"""How tracing is turned on: `serve --tracing` or KV_RENDEZVOUS_TRACING=1, exporting over OTLP or to a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rendezvous.cli import build_parser
from rendezvous.protocol import tracing

REPO = Path(__file__).resolve().parents[2]


def test_serve_traces_with_the_flag_or_its_variable_and_not_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENABLE_ENV, raising=False)
    assert build_parser().parse_args(["serve"]).tracing is False
    assert build_parser().parse_args(["serve", "--tracing"]).tracing is True
    monkeypatch.setenv(tracing.ENABLE_ENV, "1")
    assert build_parser().parse_args(["serve"]).tracing is True
    assert build_parser().parse_args(["serve", "--tracing=off"]).tracing is False


def test_the_variable_unset_leaves_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENABLE_ENV, raising=False)
    assert not tracing.configure_from_env("test")
    monkeypatch.setenv(tracing.ENABLE_ENV, "0")
    assert not tracing.configure_from_env("test")


def test_with_the_variables_set_each_finished_span_is_a_json_line_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    code = (
        "from rendezvous.protocol import tracing\n"
        "assert tracing.configure_from_env('kv-test')\n"
        "with tracing.span('request', tracing.about(transfer_id='t1')):\n"
        "    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), tracing.ENABLE_ENV: "1", tracing.FILE_ENV: str(path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = path.read_text().splitlines()
    span = json.loads(line)
    assert span["name"] == "request" and span["attributes"] == {"kv_rendezvous.transfer_id": "t1"}
    assert span["resource"]["attributes"]["service.name"] == "kv-test"


def test_processes_seeded_alike_still_mint_different_ids(tmp_path: Path) -> None:
    """vLLM seeds `random` (--seed 0 in the tests): two engines must not mint the same span ids."""
    path = tmp_path / "spans.jsonl"
    code = (
        "import random\n"
        "from rendezvous.protocol import tracing\n"
        "random.seed(0)\n"
        "assert tracing.configure_from_env('kv-test')\n"
        "with tracing.span('request'):\n"
        "    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), tracing.ENABLE_ENV: "1", tracing.FILE_ENV: str(path)}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
    first, second = (json.loads(line)["context"] for line in path.read_text().splitlines())
    assert first["span_id"] != second["span_id"] and first["trace_id"] != second["trace_id"]
