"""NIXL data plane: register KV regions, push (WRITE) or pull (READ) whole blocks between engine ranks.

- `NixlEndpoint`: one NIXL agent (UCX, no progress thread) with its regions and cached peers; one thread owns it.
- `TransferWriter`: the producer's background writer thread, fed assignments and ready source blocks (or parts
  of them, posted while prefill computes the rest).
- `TransferReceiver`: the consumer's notifications ("<transfer_id>:<generation>") and pull-mode reads.
- `ProducerAgent` / `ConsumerAgent`: an engine rank's data plane wired to its rendezvous session: claims,
  ready blocks, assignments, writes, revocations and results.
- `DataPlaneMetrics`: the agents' Prometheus histograms (write time, arrival to result), per registry.

NIXL itself is imported when the first endpoint is created; this package imports without it.
"""

from rendezvous.clients._types import KvRegion, MemoryKind, NixlAgentInfo
from rendezvous.clients.nixl.agent import NixlEndpoint, PostedTransfer, XferStatus
from rendezvous.clients.nixl.consumer import AgentReason, ConsumerAgent, TransferResult
from rendezvous.clients.nixl.errors import (
    BlockRangeError,
    DataPlaneError,
    LayoutMismatchError,
    PeerError,
    TransferFailedError,
)
from rendezvous.clients.nixl.metrics import DataPlaneMetrics
from rendezvous.clients.nixl.notifications import TransferNotification, encode_notification, parse_notification
from rendezvous.clients.nixl.polling import PollConfig
from rendezvous.clients.nixl.producer import ProducerAgent, WriteReport
from rendezvous.clients.nixl.receiver import TransferReceiver
from rendezvous.clients.nixl.regions import DescriptorTable, memory_kind_of, regions_from_tensors, registration_spans
from rendezvous.clients.nixl.writer import (
    OnComplete,
    OnCompleteParts,
    OnRevoked,
    OnSourceFree,
    OnWritten,
    TransferWriter,
    WriterConfig,
    WrittenPart,
)

__all__ = [
    "AgentReason",
    "BlockRangeError",
    "ConsumerAgent",
    "DataPlaneError",
    "DataPlaneMetrics",
    "DescriptorTable",
    "KvRegion",
    "LayoutMismatchError",
    "MemoryKind",
    "NixlAgentInfo",
    "NixlEndpoint",
    "OnComplete",
    "OnCompleteParts",
    "OnRevoked",
    "OnSourceFree",
    "OnWritten",
    "PeerError",
    "PollConfig",
    "PostedTransfer",
    "ProducerAgent",
    "TransferFailedError",
    "TransferNotification",
    "TransferReceiver",
    "TransferResult",
    "TransferWriter",
    "WriteReport",
    "WriterConfig",
    "WrittenPart",
    "XferStatus",
    "encode_notification",
    "memory_kind_of",
    "parse_notification",
    "regions_from_tensors",
    "registration_spans",
]
