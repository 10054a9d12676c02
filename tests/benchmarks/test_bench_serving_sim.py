"""bench_serving_sim end to end at a tiny size: push and push-progressive (layer-wise and chunk-wise) report
every figure, and every request's bytes arrive intact (the consumer checks them against the producer's stamps)."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

from bench_serving_sim import PROGRESSIVE, PUSH, parser, run

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

TINY = "--requests 3 --warmup 1 --rates 50 --prompt-tokens 40,96 --prefill-us-per-token 10 --decode-step-ms 1"
TINY += " --output-tokens 2 --model llama-3.1-8b --kv-scale 128 --pool-blocks 64 --modes push,push-progressive"


@pytest.mark.parametrize(
    "options",
    ["--progressive layer", "--progressive chunk --chunk-tokens 32 --tp 2:1 --verify bytes"],
    ids=["layer", "chunk-tp2:1-bytes"],
)
def test_a_tiny_run_reports_every_figure_with_every_request_intact(options: str) -> None:
    args = parser().parse_args(f"{TINY} {options}".split())
    results = run(args)["results"]
    assert [(r["prompt_tokens"], r["rate"]) for r in results] == [(40, 50.0), (96, 50.0)]
    for row in results:
        for mode in (PUSH, PROGRESSIVE):
            assert row[mode]["verified"] == args.requests
            assert row[mode]["ttft"]["mean_ms"] > 0 and row[mode]["write"]["p50_ms"] >= 0
        assert row[PUSH]["parts"] == 0 and row[PROGRESSIVE]["parts"] >= 0  # parts go ahead if assigned in time
        for figure in ("ideal", "ideal-compute"):
            assert row[figure]["ttft"]["mean_ms"] > 0
        for ratio in ("push_over_ideal", "progressive_over_ideal_compute", "push_over_progressive"):
            assert row[f"{ratio}_ttft"] > 0
