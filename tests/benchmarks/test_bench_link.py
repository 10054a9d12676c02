"""bench_link's own arithmetic and plumbing: what the run inside a lab is told, E2E, ratios (no lab, no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_link import inner_argv, kv_bytes_per_token, parse_args, placement, ratios, with_e2e
from bench_vllm import RequestResult
from netlab import Lab

LAB = Lab("0a1b2c", "kvl-0a1b2c-p", "kvl-0a1b2c-d", "kvl0a1b2cp", "kvl0a1b2cd", "169.254.77.1", "169.254.77.2")


def test_the_run_inside_a_lab_gets_every_setting() -> None:
    settings = "--modes ours,pull --prompt-lens 64,300 --requests 5 --rate 2 --output-len 16 --warmup 3 --seed 7"
    outer = parse_args([*settings.split(), "--prefill-chunk", "32", "--kv-blocks", "64"])
    inner = parse_args(inner_argv(outer, Path("/m"), Path("/p.json"), Path("/logs"))[2:])
    assert inner.inside and (inner.model, inner.part, inner.log_dir) == (Path("/m"), Path("/p.json"), Path("/logs"))
    for name in ("modes", "prompt_lens", "requests", "rate", "output_len", "warmup", "seed", "prefill_chunk"):
        assert getattr(inner, name) == getattr(outer, name), name
    assert inner.kv_blocks == 64


def test_prefill_runs_in_its_namespace_and_the_service_where_both_reach_it() -> None:
    placed = placement(LAB)
    assert placed.prefill.host == "169.254.77.1"
    assert placed.prefill.prefix[-2:] == ("0a1b2c", "prefill")
    assert placed.decode.host == placed.service_host == "169.254.77.2"
    assert placed.decode.prefix[-1] == "decode"


def test_e2e_is_the_time_to_the_last_token() -> None:
    done = RequestResult("ours", 1.0, 0, ttft=0.100, tpot=0.010, tokens=11)
    failed = RequestResult("ours", 1.0, 1, error="HTTP 500")
    summary = with_e2e([done, failed])
    assert summary["e2e_p50_ms"] == pytest.approx(200.0)
    assert (summary["ok"], summary["errors"]) == (1, 1)


def test_ratios_are_p50_over_the_base_mode_and_skip_what_is_missing() -> None:
    summary = {
        "ours": {"ttft_p50_ms": 100.0, "tpot_p50_ms": 10.0, "e2e_p50_ms": 400.0},
        "ours-progressive": {"ttft_p50_ms": 80.0, "tpot_p50_ms": 10.0, "e2e_p50_ms": 380.0},
        "pull": {"ttft_p50_ms": 150.0},
    }
    assert ratios(summary, "ours") == {
        "ours-progressive": pytest.approx({"ttft": 0.8, "tpot": 1.0, "e2e": 0.95}),
        "pull": pytest.approx({"ttft": 1.5}),
    }
    assert ratios(summary, "plain") == {}


def test_kv_per_token_counts_keys_and_values_of_every_layer() -> None:
    assert kv_bytes_per_token({"num_hidden_layers": 8, "num_key_value_heads": 8}) == 32 * 1024


def test_prompts_must_fit_the_model_length() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--prompt-lens", "500", "--output-len", "32"])
