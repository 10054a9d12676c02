"""The demo's phase breakdown from its engines' reports: every figure a duration between stamps where the first
precedes the second, whichever engine stamped them and in whichever order their reports come."""

from __future__ import annotations

import argparse
import queue
from typing import Any, cast

import pytest

pytest.importorskip("numpy")  # the demo's engines fill and check their blocks with numpy

from rendezvous.clients.demo import DemoSummary, _Engines, _route, add_demo_arguments

# time.monotonic() stamps of one push transfer as a run on a loaded machine had them: the consumer's result
# (the notification polled) came before the producer's writer saw its WRITE done.
READY, ASSIGNED, WRITTEN, COMPLETED = 100.000, 100.001, 100.0105, 100.012
ARRIVED = 100.0102


class _StandIn:
    """An engine's command queue that answers each transfer at once with the reports the engine would send."""

    def __init__(self, role: str, reports: queue.Queue[tuple[Any, ...]], result_first: bool) -> None:
        self.role, self.reports, self.result_first = role, reports, result_first

    def put(self, command: tuple[Any, ...]) -> None:
        _, transfer_id, n, _seed, _mode = command
        if self.role == "consumer" and self.result_first:
            self.reports.put(("done", transfer_id, True, n, 0.02, "", ARRIVED))
        if self.role == "producer":
            self.reports.put(("write", transfer_id, True, READY, ASSIGNED, WRITTEN, COMPLETED))
            if not self.result_first:
                self.reports.put(("done", transfer_id, True, n, 0.02, "", ARRIVED))
            self.reports.put(("freed", transfer_id))


def _engines(result_first: bool) -> _Engines:
    reports: queue.Queue[tuple[Any, ...]] = queue.Queue()
    engines = cast(Any, argparse.Namespace(reports=reports, producers=["p"], consumers=["c"]))
    engines.commands = {
        "p": _StandIn("producer", reports, result_first),
        "c": _StandIn("consumer", reports, result_first),
    }
    return cast(_Engines, engines)


@pytest.mark.parametrize("result_first", [True, False], ids=["result-first", "write-report-first"])
def test_arrival_is_timed_from_when_the_write_could_be_posted(result_first: bool) -> None:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    args = parser.parse_args(["--transfers", "3", "--concurrency", "1", "--quiet"])
    summary = DemoSummary()
    _route(_engines(result_first), args, summary)
    assert summary.verified == 3
    # Was ARRIVED - WRITTEN: -0.3 ms, the producer's poll of its WRITE against the consumer's of the notification.
    assert summary.arrival == [pytest.approx(ARRIVED - ASSIGNED)] * 3
    assert summary.write == [pytest.approx(WRITTEN - ASSIGNED)] * 3
    assert summary.commit == [pytest.approx(COMPLETED - WRITTEN)] * 3
    assert summary.match_wait == [pytest.approx(ASSIGNED - READY)] * 3
