"""bench_router end to end at a small size: every request answered through the real router, the threshold obeyed,
the KV index fed by the simulated engines and used."""

from __future__ import annotations

import argparse
import random

from bench_router import _main, _mixed_prompts


async def test_a_small_run_answers_every_request_and_obeys_the_threshold() -> None:
    args = argparse.Namespace(
        requests=24, rate=200.0, seeds=1, prefill=2, decode=2, cache_blocks=64, prefill_us_per_token=1.0,
        write_us_per_token=0.1, handoff_ms=0.5, decode_step_ms=0.5, load_weight=1.0, groups=3, prefix_tokens=64,
        suffix_tokens=8, short_tokens=16, long_tokens=128, short_share=0.5, local_prefill_below=32,
        workloads=["prefix", "shared", "mixed"], refresh_interval=0.01,
    )  # fmt: skip
    results = await _main(args)
    placements = {"round-robin", "least-loaded", "prefix-aware (memory)", "index"}
    assert set(results["prefix"]) == set(results["shared"]) == placements
    assert results["shared"]["index"]["runs"][0]["routers"] == 2
    assert results["shared"]["index"]["runs"][0]["placed_by_index"] > 0  # the engines fed it, the routers used it
    assert results["shared"]["prefix-aware (memory)"]["runs"][0]["placed_by_index"] == 0
    for variants in results.values():
        for variant in variants.values():
            assert sum(variant["runs"][0]["prefill"].values()) == args.requests
    shorts = sum(len(p) < 32 for p in _mixed_prompts(random.Random(0), args))
    assert results["mixed"]["least-loaded+local<32"]["runs"][0]["prefill"].get("local-short", 0) == shorts
    assert results["mixed"]["least-loaded"]["runs"][0]["prefill"] == {"remote": args.requests}
