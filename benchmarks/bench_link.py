"""TTFT, TPOT and E2E of real vLLM-CPU engines whose KV crosses a real, shaped link, per link rate and prompt length.

    .venv/bin/python benchmarks/bench_link.py                    # every mode, links 1/5/25 Gbit/s, 3 lengths
    .venv/bin/python benchmarks/bench_link.py --links 5gbit --modes ours --prompt-lens 256 --requests 3  # smoke

Needs root: each link rate gets its own lab (scripts/netlab.sh): network namespaces prefill and decode joined by a
veth pair shaped with tbf on both ends, UCX over TCP on it (UCX_TLS=tcp, UCX_NET_DEVICES=<veth>). Where namespaces
cannot be made it says why and exits 3 (netlab.sh check).

Who runs where. This script runs again inside the lab's decode namespace (`--inside`, through `netlab.sh run`) and
from there starts, one mode at a time, the prefill engine in the prefill namespace (serving on 169.254.77.1) and
everything else in the decode namespace: the decode engine (169.254.77.2), ours' kv-rendezvous server (on
169.254.77.2, so the prefill engine reaches it across the link), the router or proxy and the load (on 127.0.0.1).
The plain engine runs in the prefill namespace: its requests cross the link as every other mode's prefill leg does.
All of it ends with the lab (`netlab.sh run` removes it, and with it whatever still runs in it).

Modes (benchmarks/bench_vllm.py's): `plain` (one engine, no connector: the compute floor), `pull` (vLLM's
NixlConnector: decode READs after prefill), `ours` (RendezvousConnector: prefill WRITEs whole requests),
`ours-progressive` (parts per prefill chunk of `--prefill-chunk` tokens, written while the next chunk computes) and
`ours-progressive-layers` (parts per layer). vLLM's push connector is left out: its proxy must be told prefill's
NIXL address, which bench_vllm only knows on 127.0.0.1.

The model: scripts/make_tiny_model.py with random weights, made big enough that the WRITE takes about as long as
the compute (default: 8 layers, 8 KV heads of 64, float32: 32 KiB of KV per token, so 448 tokens are 14 MiB, about
117 ms at 1 Gbit/s, 23 ms at 5, 5 ms at 25). Every mode gets the same prompts per length (random token ids) and
greedy outputs are compared across modes. Reported per link and length: TTFT, TPOT and E2E (TTFT + TPOT x (tokens
- 1)) p50 and mean, as milliseconds and as ratios to `ours` and to `plain`; the bytes each end of the link sent
while each mode ran (tbf's counters: the KV that crossed, warm-up included); the machine's load average before
and after. Results go to `--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_vllm import (  # noqa: E402
    Placement,
    RequestResult,
    Setup,
    Side,
    deployed,
    machine_info,
    measure,
    mismatches,
    parse_modes,
    percentile,
    summarize,
    vocab_size,
)
from netlab import EXIT_REFUSED, SCRIPT, Lab, Role, down, why_not  # noqa: E402

from rendezvous.connector.launch import MAX_MODEL_LEN, build_tiny_model  # noqa: E402

LINK_MODES = ("plain", "pull", "ours", "ours-progressive", "ours-progressive-layers")
MODEL_SHAPE = {"layers": 8, "heads": 8, "kv_heads": 8, "hidden": 256, "intermediate": 512}
"""scripts/make_tiny_model.py's sizes for the link model."""
CONFIG_SHAPE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")
HEAD_BYTES = 64 * 4  # head_dim 64, float32
METRICS = ("ttft", "tpot", "e2e")
ROLES: tuple[Role, Role] = ("prefill", "decode")
MIB = 1024**2


def kv_bytes_per_token(config: dict[str, int]) -> int:
    """Keys and values of every layer and KV head for one token, from a model's config.json."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * HEAD_BYTES


# ---------------------------------------------------------------------------------------------------------------
# Inside the lab (decode namespace)


def placement(lab: Lab) -> Placement:
    """Prefill engines in the prefill namespace, decode engines and the service in the decode namespace."""
    prefill = Side(lab.prefill_addr, tuple(lab.exec_argv("prefill")))
    decode = Side(lab.decode_addr, tuple(lab.exec_argv("decode")))
    return Placement(prefill, decode, service_host=lab.decode_addr)


def with_e2e(results: Sequence[RequestResult]) -> dict[str, Any]:
    """bench_vllm's summary plus E2E p50 and mean (ms): a request's time to its last token."""
    summary = summarize(results)
    e2e = [
        (r.ttft + r.tpot * (r.tokens - 1)) * 1000
        for r in results
        if r.error is None and r.ttft is not None and r.tpot is not None
    ]
    if e2e:
        summary.update(e2e_mean_ms=statistics.fmean(e2e), e2e_p50_ms=percentile(e2e, 50))
    return summary


def inside(args: argparse.Namespace) -> int:
    """Every mode, one after another, at every prompt length, on this lab's link; write the part file."""
    lab = Lab.from_env(os.environ)
    engine_extra = ("--num-gpu-blocks-override", str(args.kv_blocks))
    setup = Setup(prefill_chunk=args.prefill_chunk, placement=placement(lab), engine_extra=engine_extra)
    vocab = vocab_size(args.model)
    by_length: dict[int, list[RequestResult]] = {length: [] for length in args.prompt_lens}
    failures: dict[str, str] = {}
    crossed: dict[str, dict[str, int]] = {}
    for mode in args.modes:
        sent = {role: lab.sent_bytes(role) for role in ROLES}
        with deployed([mode], args.model, args.log_dir, setup) as deployments:
            for length in args.prompt_lens:
                load = argparse.Namespace(
                    prompt_len=(length, length),
                    warmup=args.warmup,
                    output_len=args.output_len,
                    rates=[args.rate],
                    requests=args.requests,
                    seed=args.seed,
                    rounds=1,
                )
                by_length[length] += asyncio.run(measure(deployments, load, vocab))
            failures.update({d.mode: d.error for d in deployments if d.error is not None})
        crossed[mode] = {f"{role}_sent_bytes": lab.sent_bytes(role) - sent[role] for role in ROLES}
    part = {
        "failed_modes": failures,
        "link_bytes": crossed,
        "lengths": {
            str(length): {
                "summary": {m: with_e2e([r for r in results if r.mode == m]) for m in args.modes if m not in failures},
                "output_mismatches": mismatches(results, args.modes),
                "requests": [{k: v for k, v in vars(r).items() if k != "token_ids"} for r in results],
            }
            for length, results in by_length.items()
        },
    }
    args.part.write_text(json.dumps(part, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Outside: one lab per link rate, then the report


def inner_argv(args: argparse.Namespace, model: Path, part: Path, log_dir: Path) -> list[str]:
    """This script's command line inside a lab."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--inside", "--part", str(part), "--model", str(model)]
    argv += ["--log-dir", str(log_dir), "--modes", ",".join(args.modes)]
    argv += ["--prompt-lens", ",".join(map(str, args.prompt_lens)), "--requests", str(args.requests)]
    argv += ["--rate", str(args.rate), "--output-len", str(args.output_len), "--warmup", str(args.warmup)]
    argv += ["--seed", str(args.seed), "--prefill-chunk", str(args.prefill_chunk), "--kv-blocks", str(args.kv_blocks)]
    return argv


def run_link(args: argparse.Namespace, link: str, model: Path, scratch: Path) -> dict[str, Any]:
    """One lab at `link`, the benchmark inside it; the lab is removed however this ends."""
    lab_id = os.urandom(3).hex()
    part, log_dir = scratch / f"{link}.json", scratch / link
    log_dir.mkdir()
    argv = [str(SCRIPT), "run", "--rate", link, "--id", lab_id, "--", *inner_argv(args, model, part, log_dir)]
    print(f"link {link}: lab {lab_id}, logs in {log_dir}", flush=True)
    try:
        returncode = subprocess.run(argv, cwd=REPO, timeout=args.link_timeout).returncode
    except subprocess.TimeoutExpired:
        returncode = -1
    finally:
        down(lab_id)
    if not part.exists():
        return {"error": f"the benchmark in the lab ended with {returncode} and wrote no results (logs: {log_dir})"}
    result: dict[str, Any] = json.loads(part.read_text())
    return result


def ratios(summary: dict[str, dict[str, Any]], base: str) -> dict[str, dict[str, float]]:
    """Each mode's p50 TTFT, TPOT and E2E over `base`'s."""
    out: dict[str, dict[str, float]] = {}
    for mode, s in summary.items():
        cells = {
            metric: s[f"{metric}_p50_ms"] / summary[base][f"{metric}_p50_ms"]
            for metric in METRICS
            if f"{metric}_p50_ms" in s and summary.get(base, {}).get(f"{metric}_p50_ms")
        }
        if mode != base and cells:
            out[mode] = cells
    return out


def format_table(links: dict[str, dict[str, Any]]) -> str:
    """Per link and length, one row per mode: p50 TTFT/TPOT/E2E in ms and their ratios to ours."""
    header = (
        f"{'link':>7} {'len':>4} {'mode':<24} {'ok/n':>6} {'ttft':>8} {'tpot':>7} {'e2e':>8}   x ours (ttft tpot e2e)"
    )
    lines = [header, "-" * len(header)]
    for link, found in links.items():
        if "error" in found:
            lines.append(f"{link:>7} FAILED: {found['error']}")
            continue
        for length, at in found["lengths"].items():
            to_ours = ratios(at["summary"], "ours")
            for mode, s in at["summary"].items():
                ms = " ".join(
                    f"{s[f'{m}_p50_ms']:{w}.1f}" if f"{m}_p50_ms" in s else f"{'-':>{w}}"
                    for m, w in zip(METRICS, (8, 7, 8), strict=True)
                )
                vs = " ".join(f"{to_ours[mode][m]:.2f}" for m in METRICS if m in to_ours.get(mode, {}))
                lines.append(f"{link:>7} {length:>4} {mode:<24} {s['ok']:>2}/{s['requests']:<3} {ms}   {vs}")
            if at["output_mismatches"]:
                lines.append(f"{link:>7} {length:>4} output mismatches across modes: {len(at['output_mismatches'])}")
        for mode, error in found["failed_modes"].items():
            lines.append(f"{link:>7} {mode} FAILED: {error[:300]}")
        for mode, crossed in found["link_bytes"].items():
            p_mib, d_mib = crossed["prefill_sent_bytes"] / MIB, crossed["decode_sent_bytes"] / MIB
            lines.append(f"{link:>7} {mode}: {p_mib:.1f} MiB prefill -> decode, {d_mib:.1f} MiB back, over the link")
    return "\n".join(lines)


def outside(args: argparse.Namespace) -> int:
    reason = why_not()
    if reason is not None:
        print(f"bench_link: cannot run here: {reason}", file=sys.stderr)
        return EXIT_REFUSED
    scratch = Path(tempfile.mkdtemp(prefix="bench-link-", dir=args.log_dir))
    model = args.model or build_tiny_model(scratch / "link-model", **MODEL_SHAPE)
    shape = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k in CONFIG_SHAPE}
    load_before, started = os.getloadavg(), time.monotonic()
    links = {link: run_link(args, link, model, scratch) for link in args.links}
    report = {
        "benchmark": "bench_link",
        "description": "TTFT/TPOT/E2E of 1P1D vLLM-CPU engines in two network namespaces joined by a tbf-shaped "
        "veth link (scripts/netlab.sh), UCX over TCP on it: plain, pull (NixlConnector), ours, ours-progressive",
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {
            "links": list(args.links),
            "modes": list(args.modes),
            "prompt_lens": list(args.prompt_lens),
            "requests_per_mode_per_length": args.requests,
            "rate_rps": args.rate,
            "output_len": args.output_len,
            "warmup": args.warmup,
            "seed": args.seed,
            "prefill_chunk": args.prefill_chunk,
            "kv_blocks": args.kv_blocks,
            "model": str(model),
            "model_shape": shape,
            "kv_bytes_per_token": kv_bytes_per_token(shape),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "links": links,
        "ratios_p50": {
            link: {
                length: {"to_ours": ratios(at["summary"], "ours"), "to_plain": ratios(at["summary"], "plain")}
                for length, at in found.get("lengths", {}).items()
            }
            for link, found in links.items()
        },
    }
    report["table"] = format_table(links)
    print(report["table"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all("error" not in found and not found["failed_modes"] for found in links.values()) else 1


# ---------------------------------------------------------------------------------------------------------------
# Command line


def parse_lens(text: str) -> tuple[int, ...]:
    lens = tuple(int(x) for x in text.split(",") if x.strip())
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"bad prompt lengths {text!r}")
    return lens


def parse_link_modes(text: str) -> tuple[str, ...]:
    modes = parse_modes(text)
    if set(modes) - set(LINK_MODES):
        raise argparse.ArgumentTypeError(f"modes must be among {','.join(LINK_MODES)}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--links", type=lambda s: s.split(","), default=["1gbit", "5gbit", "25gbit"])
    parser.add_argument("--modes", type=parse_link_modes, default=LINK_MODES, help=",".join(LINK_MODES))
    parser.add_argument("--prompt-lens", type=parse_lens, default=(128, 256, 448), help="tokens, comma-separated")
    parser.add_argument("--requests", type=int, default=12, help="measured requests per mode, length and link")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per mode and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunk", type=int, default=128, help="--max-num-batched-tokens of prefill engines")
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV blocks per engine (32 tokens each)")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: build the link model)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "link.json")
    parser.add_argument("--log-dir", type=Path, default=None, help="where logs go (default: a temp dir)")
    parser.add_argument("--link-timeout", type=float, default=3600.0, help="seconds per link before giving up")
    # Internal: the run inside a lab.
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if max(args.prompt_lens) + args.output_len > MAX_MODEL_LEN:
        parser.error(f"prompt + output must fit max_model_len {MAX_MODEL_LEN}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    return inside(args) if args.inside else outside(args)


if __name__ == "__main__":
    sys.exit(main())
