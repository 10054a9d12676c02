"""A short run of the chaos benchmark (benchmarks/chaos.py): two replicas on one Redis, consumer and producer
engines doing push transfers (aborts after assignment, generation bumps, failures included) while engines crash
and come back as new incarnations, one replica is SIGKILLed and Redis is SIGKILLed once (restarted from its
AOF). Afterwards: no live transfer, no pinned consumer block, no assignment naming a dead or foreign incarnation.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.redis_fixtures import REDIS_SERVER

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"
INVARIANTS = ("no_live_transfers", "no_pinned_blocks", "assignments_name_live_registering_incarnation")


def _chaos() -> ModuleType:
    """benchmarks/chaos.py as a module (benchmarks/ is not a package)."""
    module = sys.modules.get("chaos_benchmark")
    if module is None:
        spec = importlib.util.spec_from_file_location("chaos_benchmark", CHAOS)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look up their module
        spec.loader.exec_module(module)
    return module


def _explain(result: dict[str, Any], name: str) -> str:
    return (
        f"{name}: {json.dumps(result['invariants'][name], indent=1)[:4000]}\n"
        f"event sequences: {json.dumps(result['traces'], indent=1)[:6000]}"
    )


async def test_a_short_chaos_run_keeps_the_invariants(tmp_path: Path) -> None:
    if REDIS_SERVER is None:
        pytest.skip("needs a redis-server binary (the run SIGKILLs and restarts its own)")
    chaos = _chaos()
    config = chaos.ChaosConfig(
        seed=11,
        duration=24.0,
        crash_every=2.0,
        replica_kills=1,
        redis_kills=1,
        redis_wipe_fraction=0.0,
        out=tmp_path / "chaos.json",
        quiet=True,
    )
    result = await chaos.run(config)

    assert json.loads(config.output().read_text())["ok"] == result["ok"]
    counts = result["counts"]
    assert (counts["replica_kills"], counts["redis_kills"]) == (1, 1), result["infrastructure_events"]
    assert counts["crashes"] + counts["graceful_restarts"] > 0
    assert counts["lifecycles_completed"] > 0
    assert counts["assignments"] > 0
    for name in INVARIANTS:
        assert result["invariants"][name]["ok"], _explain(result, name)
