"""The data plane's exception tree.

Everything the NIXL data plane raises on purpose is a `DataPlaneError`::

    DataPlaneError
    ├── BlockRangeError      (also a ValueError) a block id is outside a region, or the lists differ in length
    ├── LayoutMismatchError  (also a ValueError) the peer's regions do not pair with ours
    ├── PeerError            unknown peer, unreadable metadata, or a stale incarnation
    ├── TransferFailedError  NIXL refused to post a transfer, reported it failed, or raised reading notifications
    └── WriteFencedError     the engine's lease is not certainly held: the writer posts nothing more

They are raised before anything is posted, except `TransferFailedError`, whose transfer may have moved part
of its bytes.
"""

from __future__ import annotations


class DataPlaneError(Exception):
    """Base class of the errors of the NIXL data plane."""


class BlockRangeError(DataPlaneError, ValueError):
    """Block ids that do not address blocks of every region; nothing was posted."""


class LayoutMismatchError(DataPlaneError, ValueError):
    """Two agents' regions differ in count or per-region block length, so blocks cannot pair up."""


class PeerError(DataPlaneError):
    """A remote agent is unknown, its metadata is invalid, or its incarnation is older than the cached one."""


class TransferFailedError(DataPlaneError):
    """NIXL failed to post a transfer, reported an error while moving it, or raised reading notifications."""


class WriteFencedError(DataPlaneError):
    """The producer engine's lease is not certainly held any more (its session's write fence passed): the writer
    posted nothing, since the service may have lapsed the lease and the consumer reused its blocks."""
