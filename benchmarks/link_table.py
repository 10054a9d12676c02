"""RESULTS.md tables from several bench_link runs: per link, length and mode, the median (min-max) of the runs' p50s.

    .venv/bin/python benchmarks/link_table.py benchmarks/results/link-25gbit-{1,2,3}.json

Each run's p50 TTFT, TPOT and E2E and its ratios to `ours` (taken within the run, so a slow run moves both modes)
become one cell each: the median of the runs, then (min-max). `ok` counts the answered requests of all runs. Under
each link's table: per length, the KV a prompt writes and how long that takes at the link's nominal rate, against
the compute it could hide behind (plain's TTFT, which has no transfer, per layer and per prefill chunk); then per
run its file, load averages, wall time, output mismatches and failed modes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = ("ttft", "tpot", "e2e")
BASE = "ours"
RATE_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9}


@dataclass
class Cell:
    """One mode at one link and length, over the runs."""

    ok: int = 0
    requests: int = 0
    p50_ms: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    to_base: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})


def link_bits_per_s(link: str) -> float:
    """tc's rate ('25gbit', '500mbit') in bits per second."""
    found = re.fullmatch(r"(\d+)([kmg])bit", link)
    if found is None:
        raise ValueError(f"bad link rate {link!r}")
    return int(found[1]) * RATE_UNITS[found[2]]


def spread(values: Sequence[float], digits: int) -> str:
    """'median (min-max)' with thousands separators; '-' when there is nothing."""
    if not values:
        return "-"
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def collect(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Cell]]]:
    """link -> length -> mode -> Cell, modes and lengths in the order the runs give them."""
    cells: dict[str, dict[int, dict[str, Cell]]] = {}
    for run in runs:
        for link, found in run["links"].items():
            for length, at in found.get("lengths", {}).items():
                summary = at["summary"]
                base = summary.get(BASE, {})
                for mode, s in summary.items():
                    cell = cells.setdefault(link, {}).setdefault(int(length), {}).setdefault(mode, Cell())
                    cell.ok += s["ok"]
                    cell.requests += s["requests"]
                    for m in METRICS:
                        value = s.get(f"{m}_p50_ms")
                        if value is None:
                            continue
                        cell.p50_ms[m].append(value)
                        if base.get(f"{m}_p50_ms"):
                            cell.to_base[m].append(value / base[f"{m}_p50_ms"])
    return cells


def table(by_length: dict[int, dict[str, Cell]]) -> list[str]:
    """One link's markdown table, RESULTS.md's "Across a shaped link" format."""
    lines = [
        "| len | mode | TTFT p50 ms | TPOT p50 ms | E2E p50 ms | TTFT / ours | TPOT / ours | E2E / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length, modes in sorted(by_length.items()):
        for mode, cell in modes.items():
            ms = " | ".join(spread(cell.p50_ms[m], 1) for m in METRICS)
            vs = " | ".join("1" if mode == BASE else spread(cell.to_base[m], 2) for m in METRICS)
            lines.append(f"| {length} | {mode} ({cell.ok}/{cell.requests}) | {ms} | {vs} |")
    return lines


def bounds(link: str, by_length: dict[int, dict[str, Cell]], params: dict[str, Any]) -> list[str]:
    """Per length: the WRITE at the nominal rate against plain's compute per layer and per prefill chunk."""
    layers = params["model_shape"]["num_hidden_layers"]
    lines = []
    for length, modes in sorted(by_length.items()):
        kv = params["kv_bytes_per_token"] * length
        write_ms = kv * 8 / link_bits_per_s(link) * 1000
        line = f"- {length} tokens: {kv / 2**20:.1f} MiB of KV, {write_ms:.1f} ms at {link}"
        plain = modes.get("plain")
        if plain is not None and plain.p50_ms["ttft"]:
            ttft = statistics.median(plain.p50_ms["ttft"])
            chunks = -(-length // params["prefill_chunk"])
            line += f"; plain TTFT {ttft:.1f} ms: {ttft / layers:.1f} ms a layer, {ttft / chunks:.1f} ms a chunk"
        lines.append(line)
    return lines


def run_line(path: Path, run: dict[str, Any]) -> str:
    """One run's file, load averages (1 minute) at its start and end, wall time, mismatches and failures."""
    machine = run["machine"]
    before, after = machine["loadavg_before"][0], machine["loadavg_after"][0]
    mismatched = sum(
        len(at["output_mismatches"]) for f in run["links"].values() for at in f.get("lengths", {}).values()
    )
    failed = [f"{link}: {', '.join(f['failed_modes'])}" for link, f in run["links"].items() if f.get("failed_modes")]
    errors = [f"{link}: {f['error']}" for link, f in run["links"].items() if "error" in f]
    line = f"- {path.name}: load {before:.2f} before, {after:.2f} after; {run['wall_s']:.0f} s; {mismatched} mismatches"
    return line + "".join(f"; FAILED {x}" for x in failed + errors)


def report(paths: Sequence[Path]) -> str:
    """Every link's table, bounds and runs, from the result files."""
    runs = [json.loads(p.read_text()) for p in paths]
    out: list[str] = []
    for link, by_length in collect(runs).items():
        with_link = [(p, r) for p, r in zip(paths, runs, strict=True) if link in r["links"]]
        out += [f"{link} ({len(with_link)} runs):", "", *table(by_length), ""]
        out += bounds(link, by_length, with_link[0][1]["parameters"])
        out += [run_line(p, r) for p, r in with_link] + [""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("runs", type=Path, nargs="+", help="bench_link result files")
    args = parser.parse_args(argv)
    print(report(args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
