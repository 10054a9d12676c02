"""A conformance suite for engine authors: `kv-rendezvous conformance --target HOST:PORT`.

It drives a running rendezvous through the documented lifecycle (docs/protocol.md) and reports every
check as PASS or FAIL with a one-line reason. It is an independent client: it speaks only the wire
(gRPC, the generated stubs in `rendezvous.v1`, google.rpc ErrorInfo), never the SDK or the service's
own code, so what passes here is what any engine written against the proto will see. Every check uses
fresh engine and transfer ids (`conf-<run>-...`) in the pools `conformance-prefill` and
`conformance-decode`, and deregisters its engines, so it may run against a shared service.
"""

from rendezvous.conformance.driver import Options
from rendezvous.conformance.registry import CHECKS, Check
from rendezvous.conformance.runner import CheckResult, add_arguments, main, run_suite

__all__ = ["CHECKS", "Check", "CheckResult", "Options", "add_arguments", "main", "run_suite"]
