"""Checks of request shape that need no state: ids, block lists, registrations, timeouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import MemoryKind, Role
from rendezvous.core.regions import check_regions
from rendezvous.protocol import dataplane
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.kvmap import ShapeError, rank_shapes
from rendezvous.protocol.requests import EngineSpec


def check_id(kind: str, value: str, limits: Limits) -> None:
    """Ids are non-empty, bounded, printable and free of whitespace."""
    if not value:
        raise RendezvousError(Reason.ID_EMPTY, f"{kind} must not be empty", field=kind)
    if len(value) > limits.max_id_length:
        raise RendezvousError(
            Reason.ID_TOO_LONG,
            f"{kind} is {len(value)} characters; the limit is {limits.max_id_length}",
            field=kind,
            limit=limits.max_id_length,
        )
    # The space is the one whitespace character str.isprintable() accepts (tests/core/test_validation.py checks
    # every code point), so this is "printable, no whitespace" without a Python-level loop over the characters.
    if not value.isprintable() or " " in value:
        raise RendezvousError(Reason.ID_INVALID, f"{kind} must be printable without whitespace", field=kind)


def check_batch(size: int, limits: Limits) -> None:
    """A batch holds between one and max_batch_items items."""
    if size == 0:
        raise RendezvousError(Reason.BATCH_EMPTY, "the request has no items")
    if size > limits.max_batch_items:
        raise RendezvousError(
            Reason.BATCH_TOO_LARGE,
            f"{size} items in one request; the limit is {limits.max_batch_items}",
            limit=limits.max_batch_items,
        )


def check_block_ids(block_ids: Sequence[int], limits: Limits, num_blocks: int | None) -> None:
    """Block ids are non-negative, distinct, within the engine's pool and not too many."""
    if len(block_ids) > limits.max_blocks_per_target:
        raise RendezvousError(
            Reason.TOO_MANY_BLOCKS,
            f"more than {limits.max_blocks_per_target} blocks",
            limit=limits.max_blocks_per_target,
        )
    if block_ids and min(block_ids) < 0:
        raise RendezvousError(Reason.BLOCK_ID_NEGATIVE, f"block id {min(block_ids)} is negative")
    if len(set(block_ids)) != len(block_ids):
        raise RendezvousError(Reason.BLOCK_ID_DUPLICATE, "block ids must be distinct")
    if num_blocks is not None and block_ids and max(block_ids) >= num_blocks:
        raise RendezvousError(
            Reason.BLOCK_ID_OUT_OF_RANGE,
            f"block id {max(block_ids)} is outside the engine's {num_blocks} registered blocks",
            num_blocks=num_blocks,
        )


def resolve_timeout(requested: float, default: float, timeouts: Timeouts) -> float:
    """A requested wait in seconds, or the default when zero; negative or huge waits are rejected."""
    if requested < 0 or requested > timeouts.max_timeout:
        raise RendezvousError(
            Reason.TIMEOUT_INVALID,
            f"timeout {requested}s must be between 0 and {timeouts.max_timeout}s",
            limit=timeouts.max_timeout,
        )
    return requested or default


def check_engine_spec(spec: EngineSpec, limits: Limits) -> None:
    """A registration names itself, its role and a sane set of agents and regions."""
    check_id("engine_id", spec.engine_id, limits)
    check_id("pool", spec.pool, limits)
    if spec.role is Role.UNSPECIFIED:
        raise RendezvousError(Reason.ROLE_UNSPECIFIED, "role must be PRODUCER or CONSUMER")
    _check_labels(spec.labels, limits)
    for name in ("model_fingerprint", "dtype", "kv_layout"):
        text = getattr(spec.layout, name)
        if len(text.encode()) > limits.max_id_length:
            raise _too_large(Reason.LAYOUT_INVALID, name, f"layout {name}", limits.max_id_length)
    version = spec.layout.data_plane_version
    if not dataplane.known(version):
        raise RendezvousError(
            Reason.DATA_PLANE_VERSION_UNSUPPORTED,
            f"data_plane_version {version} is newer than this server knows ({dataplane.DATA_PLANE_VERSION}); "
            "upgrade the servers before the engines",
            data_plane_version=version,
            supported=dataplane.DATA_PLANE_VERSION,
        )
    if not spec.agents:
        raise RendezvousError(
            Reason.AGENTS_INVALID,
            "an engine registers one NIXL agent per rank (tp_size x pp_size); this one has none",
            field="agents",
        )
    if len(spec.agents) > limits.max_agents_per_engine:
        raise RendezvousError(
            Reason.AGENTS_INVALID,
            f"more than {limits.max_agents_per_engine} agents",
            limit=limits.max_agents_per_engine,
        )
    # Counted before any agent's regions are compared with each other.
    regions = sum(len(a.regions) for a in spec.agents)
    if regions > limits.max_regions_per_engine:
        raise RendezvousError(
            Reason.AGENTS_INVALID,
            f"the agents have {regions} regions; the limit is {limits.max_regions_per_engine} per engine",
            field="regions",
            limit=limits.max_regions_per_engine,
        )
    names = [a.name for a in spec.agents]
    if len(set(names)) != len(names):
        raise RendezvousError(Reason.AGENTS_INVALID, "agent names must be distinct")
    try:
        rank_shapes(spec.layout, spec.agents)
    except ShapeError as err:
        reason = Reason.AGENTS_INVALID if err.agents else Reason.LAYOUT_INVALID
        raise RendezvousError(reason, str(err), field=err.field) from None
    for agent in spec.agents:
        check_id("agent name", agent.name, limits)
        if agent.memory_kind not in (MemoryKind.DRAM, MemoryKind.VRAM):
            raise RendezvousError(
                Reason.AGENTS_INVALID,
                f"agent {agent.name} has no known memory kind; use DRAM or VRAM",
                field="memory_kind",
            )
        if len(agent.metadata) > limits.max_agent_metadata_bytes:
            raise _too_large(
                Reason.AGENTS_INVALID,
                "agents.metadata",
                f"agent {agent.name} metadata ({len(agent.metadata)} bytes)",
                limits.max_agent_metadata_bytes,
            )
        if len(agent.regions) > limits.max_regions_per_agent:
            raise RendezvousError(
                Reason.AGENTS_INVALID,
                f"agent {agent.name} has more than {limits.max_regions_per_agent} regions",
                limit=limits.max_regions_per_agent,
            )
        check_regions(agent)
    metadata_bytes = sum(len(a.metadata) for a in spec.agents)
    if metadata_bytes > limits.max_engine_agent_metadata_bytes:
        raise _too_large(
            Reason.AGENTS_INVALID,
            "agents.metadata",
            f"the agents' metadata ({metadata_bytes} bytes)",
            limits.max_engine_agent_metadata_bytes,
        )


def _check_labels(labels: Mapping[str, str], limits: Limits) -> None:
    """Labels are few and short: each key and value, and all of them together, within their byte limits.

    A peer's labels travel in other engines' events and in every ListEngines page, so their size is
    bounded like any other field a caller does not control.
    """
    if len(labels) > limits.max_labels:
        raise RendezvousError(
            Reason.LABELS_INVALID, f"more than {limits.max_labels} labels", field="labels", limit=limits.max_labels
        )
    total = 0
    for key, value in labels.items():
        key_bytes, value_bytes = len(key.encode()), len(value.encode())
        if key_bytes > limits.max_label_key_bytes:
            raise _too_large(
                Reason.LABELS_INVALID,
                "labels.key",
                f"label key {key!r} ({key_bytes} bytes)",
                limits.max_label_key_bytes,
            )
        if value_bytes > limits.max_label_value_bytes:
            raise _too_large(
                Reason.LABELS_INVALID,
                "labels.value",
                f"label {key!r}'s value ({value_bytes} bytes)",
                limits.max_label_value_bytes,
            )
        total += key_bytes + value_bytes
    if total > limits.max_labels_bytes:
        raise _too_large(Reason.LABELS_INVALID, "labels", f"the labels ({total} bytes)", limits.max_labels_bytes)


def _too_large(reason: Reason, field: str, what: str, limit: int) -> RendezvousError:
    """A size refusal that names the field and the limit, in the message and in ErrorInfo metadata."""
    return RendezvousError(reason, f"{what}: over the limit of {limit} bytes", field=field, limit=limit)
