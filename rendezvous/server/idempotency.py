"""Answers kept for a request_id's retries (AIP-155): small, bounded, and tied to the request they answer.

What is kept is a format byte, a digest of the request (`DIGEST_BYTES` of BLAKE2b over its deterministic
serialization, request_id included) and the answer, slimmed: a RegisterEngine answer repeats its request's
agent metadata, regions and labels (up to megabytes), so those are kept only where they differ from the
request and are put back from the retry, which the digest shows is the same request. A retry whose request
differs under the same request_id is refused (INVALID_ARGUMENT / REQUEST_ID_REUSED) rather than answered for
another request. An answer still over `Limits.max_answer_bytes` is not kept (a retry runs again); the store
bounds the kept answers' bytes over the server and per identity (`Store.put_response`).
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

from google.protobuf.message import Message

from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.v1 import rendezvous_pb2 as pb

DIGEST_BYTES = 16
_FORMAT = b"\xff"
"""The first byte of a kept entry: no serialized message starts with it (wire type 7 does not exist), so an
answer kept whole by an earlier version (during a rolling upgrade of replicas sharing Redis) is told apart."""

ResponseT = TypeVar("ResponseT", bound=Message)


def digest(request: Message) -> bytes:
    """The digest a kept answer is tied to."""
    return hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=DIGEST_BYTES).digest()


def entry(request: Message, response: Message, max_bytes: int) -> bytes | None:
    """What to keep for request's retries: its digest and the slimmed response; None when over max_bytes."""
    slimmed = _slim(request, response)
    kept = _FORMAT + digest(request) + slimmed.SerializeToString()
    return kept if len(kept) <= max_bytes else None


def answer(request: Any, kept: bytes, response_type: type[ResponseT]) -> ResponseT:
    """The kept answer to a retry of request, or REQUEST_ID_REUSED when it answered another request."""
    if not kept.startswith(_FORMAT):
        return response_type.FromString(kept)  # kept whole, by an earlier version
    if kept[1 : 1 + DIGEST_BYTES] != digest(request):
        raise RendezvousError(
            Reason.REQUEST_ID_REUSED,
            f"request_id {request.request_id!r} was used for a different request; use a new request_id",
            request_id=request.request_id,
        )
    response = response_type.FromString(kept[1 + DIGEST_BYTES :])
    if isinstance(response, pb.RegisterEngineResponse):
        _restore(request, response)
    return response


def _slim(request: Message, response: Message) -> Message:
    """response without the parts of a RegisterEngine answer that its request holds the same."""
    if not isinstance(response, pb.RegisterEngineResponse) or not isinstance(request, pb.RegisterEngineRequest):
        return response
    slim = pb.RegisterEngineResponse()
    slim.CopyFrom(response)
    engine = slim.engine
    if len(engine.agents) == len(request.agents):
        for sent, kept in zip(request.agents, engine.agents, strict=True):
            if kept.metadata == sent.metadata:
                kept.metadata = b""
            if list(kept.regions) == list(sent.regions):
                del kept.regions[:]
    if dict(engine.labels) == dict(request.labels):
        engine.labels.clear()
    return slim


def _restore(request: pb.RegisterEngineRequest, response: pb.RegisterEngineResponse) -> None:
    """Put back, in place, what `_slim` left out (a kept part empty where the request's is not)."""
    engine = response.engine
    if len(engine.agents) == len(request.agents):
        for sent, kept in zip(request.agents, engine.agents, strict=True):
            if not kept.metadata and sent.metadata:
                kept.metadata = sent.metadata
            if not kept.regions and sent.regions:
                kept.regions.extend(sent.regions)
    if not engine.labels and request.labels:
        engine.labels.update(request.labels)
