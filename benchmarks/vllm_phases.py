"""Where a disaggregated request's time to first token goes, from the service's record of its transfer.

The router names each request's transfer (`X-Transfer-Id`); the rendezvous keeps, per transfer, when decode
registered its target, prefill claimed it, the two matched and the last producer rank's WRITE was reported
(`TransferTimes`, wall clock of the service's host). With the client's own send and first-token times (the same
host's clock) one request's TTFT splits into:

- `to_target`, `to_claim`: from sending to decode registering its blocks / prefill claiming the transfer (the
  router's dispatch, each engine's admission of its leg and its RegisterTargets / ClaimTransfers round trip);
- `to_match`: the later of the two (the rendezvous matches them at once);
- `match_to_commit`: prefill computing the KV after its claim, the WRITE and its report (push: the producer
  tells the service nothing in between);
- `commit_to_first_token`: decode learning the KV is in, scheduling the request, one decode step, and the
  relay of its first token through the router.

Pull (vLLM's NixlConnector) has no record of ours; its proxy sends the legs one after the other and names how
long the prefill leg took (`PREFILL_LEG_HEADER`), which splits its TTFT into:

- `prefill_leg`: the proxy sending prefill its leg (max_tokens 1) until prefill answered: admission, the
  prompt's compute, its first token;
- `decode_leg`: the rest, from the proxy sending decode its leg with prefill's `kv_transfer_params` to the
  client's first token: decode's admission, the handshake with prefill (first contact), the READ on decode's
  step loop, decode's first step and the relay.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

PHASES = ("to_target", "to_claim", "to_match", "match_to_commit", "commit_to_first_token")
PULL_PHASES = ("prefill_leg", "decode_leg")
PREFILL_LEG_HEADER = "X-Prefill-Leg-Ms"
"""Response header of the pull proxy: milliseconds its prefill leg took."""


class Times(Protocol):
    """What `phases` reads of a transfer's `TransferTimes` (seconds since the epoch; 0.0: not reached)."""

    @property
    def target_time(self) -> float: ...
    @property
    def claim_time(self) -> float: ...
    @property
    def match_time(self) -> float: ...
    @property
    def commit_time(self) -> float: ...


def phases(sent: float, first_token: float, times: Times) -> dict[str, float] | None:
    """Seconds per phase of one request sent at `sent` whose first token came at `first_token`; None if its
    transfer never matched or committed (the request then did not go the disaggregated way)."""
    if not (sent and first_token and times.target_time and times.claim_time and times.match_time):
        return None
    if not times.commit_time:
        return None
    return {
        "to_target": times.target_time - sent,
        "to_claim": times.claim_time - sent,
        "to_match": times.match_time - sent,
        "match_to_commit": times.commit_time - times.match_time,
        "commit_to_first_token": first_token - times.commit_time,
    }


def pull_phases(prefill_leg: float, ttft: float) -> dict[str, float]:
    """Seconds per phase of one pull request whose prefill leg took `prefill_leg` and whose TTFT was `ttft`."""
    return {"prefill_leg": prefill_leg, "decode_leg": ttft - prefill_leg}


def median_ms(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median of each phase over `rows`, in milliseconds, in `PHASES` or `PULL_PHASES` order (phases some
    row lacks are left out)."""
    return {
        p: statistics.median(r[p] for r in rows) * 1000
        for p in (*PHASES, *PULL_PHASES)
        if rows and all(p in r for r in rows)
    }


def overhead_ms(summaries: Mapping[str, Mapping[str, Any]], baseline: str = "plain") -> dict[str, dict[str, float]]:
    """Each mode's TTFT p50 and mean minus the baseline mode's (what disaggregating costs over one engine)."""
    base = summaries.get(baseline, {})
    out: dict[str, dict[str, float]] = {}
    for mode, s in summaries.items():
        if mode == baseline:
            continue
        diffs = {k[:-3]: s[k] - base[k] for k in ("ttft_p50_ms", "ttft_mean_ms") if k in s and k in base}
        if diffs:
            out[mode] = diffs
    return out
