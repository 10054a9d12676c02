"""How one engine's KV cache maps onto another's: ranks, layers, heads and blocks.

One set of pure functions, shared by the service (is a producer/consumer pair compatible?) and the SDK (what
each producer rank's writer moves where). Nothing here does I/O or imports protobuf.

The conventions are vLLM's:

- an engine has `tp_size * pp_size` ranks, one NIXL agent each; `rank = pp_rank * tp_size + tp_rank`;
- TP rank r holds KV heads `[r * h, (r + 1) * h)` of the model's `num_kv_heads`, with `h = num_kv_heads / tp_size`
  (an engine that does not state its heads holds one opaque "head" per rank, so it only pairs with an engine of
  the same TP size);
- a pipeline stage holds a contiguous range of layers, the same on each of its TP ranks; an agent's regions are
  layer-major, `regions_per_layer` of them per layer (K and V, say), its first layer first (an engine without
  pipeline parallelism may publish regions in any other grouping: they then pair with the peer's one by one);
- a block of a region holds `block_size` tokens of every head of its rank, laid out HND (head, token, unit) or
  NHD (token, head, unit), where a unit is one token of one head: `block_length_bytes / (heads * block_size)`.

A producer rank writes, into every consumer rank whose layers and heads overlap its own, that overlap
(`shares`). Blocks pair by token position (`token_runs`): with equal block sizes the last destination blocks
take the last source blocks (the consumer may hold a prefix already); with block sizes where one divides the
other, source block i holds prompt tokens `[i * Bp, (i + 1) * Bp)` and the destination blocks hold the prompt's
last `target_tokens` tokens, starting on a destination block boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rendezvous.protocol.records import KvLayout, NixlAgent

__all__ = [
    "HEAD_MAJOR",
    "HEAD_SPLIT_LAYOUTS",
    "HKTV",
    "TOKEN_SPLIT_LAYOUTS",
    "BlockPairingError",
    "Mismatch",
    "RankShape",
    "RankShare",
    "ShapeError",
    "TokenRun",
    "element_bytes",
    "layout_mismatch",
    "rank_shape",
    "rank_shapes",
    "shares",
    "token_runs",
    "writers_into",
]

HKTV = "HKTV"
"""vLLM-CPU's block: heads one after the other; per head the keys transposed ([head_dim, block_size]), then the
values ([block_size, head_dim]). A unit (one token of one head) is 2 * head_dim elements; runs of tokens are
addressable knowing the element size (`element_bytes` of the layout's dtype)."""
TOKEN_SPLIT_LAYOUTS = ("HND", "NHD", HKTV)
"""Block layouts whose runs of tokens the data plane can address (needed when block sizes differ)."""
_ELEMENT_BYTES = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}
HEAD_MAJOR = "HEAD_MAJOR"
"""A block whose heads come one after the other, each head's bytes in an order of the engine's own (vLLM-CPU
keeps a head's keys transposed): heads split between ranks, tokens do not."""
HEAD_SPLIT_LAYOUTS = (*TOKEN_SPLIT_LAYOUTS, HEAD_MAJOR)
"""Block layouts whose head slices the data plane can address (needed when TP sizes differ)."""


class ShapeError(ValueError):
    """An engine's layout or agents do not add up. `field` names what is wrong; `agents` tells whether it
    is the agents (AGENTS_INVALID) or the layout itself (LAYOUT_INVALID)."""

    def __init__(self, field: str, message: str, *, agents: bool) -> None:
        super().__init__(message)
        self.field = field
        self.agents = agents


class BlockPairingError(ValueError):
    """Source and destination blocks of a transfer cannot be paired (too few source blocks, a destination
    that does not start on a block boundary, or token counts the blocks cannot hold)."""


@dataclass(frozen=True, slots=True)
class RankShape:
    """What one rank of an engine holds."""

    rank: int
    tp_rank: int
    pp_rank: int
    first_layer: int
    num_layers: int
    """Layers of this rank; 0 when the layout states none or, with pp_size 1, its regions are not a whole
    number per layer: all its regions then form one group, paired region by region."""
    first_head: int
    """The rank's first KV head, as an index into the model's heads."""
    num_heads: int
    """KV heads of this rank (1 opaque head per rank when the layout states no head count)."""
    num_regions: int
    regions_per_layer: int

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)

    def region_range(self, layers: range) -> range:
        """Indices of this rank's regions that hold `layers` (all regions when no layers are stated)."""
        if not self.num_layers:
            return range(self.num_regions)
        start = (layers.start - self.first_layer) * self.regions_per_layer
        return range(start, start + len(layers) * self.regions_per_layer)


@dataclass(frozen=True, slots=True)
class RankShare:
    """What one producer rank writes into one consumer rank: some layers' regions, some heads."""

    producer_rank: int
    consumer_rank: int
    producer_regions: range
    """Region indices in the producer rank's agent; `consumer_regions[i]` receives `producer_regions[i]`."""
    consumer_regions: range
    producer_head: int
    """First head written, local to the producer rank (0 = its first head)."""
    consumer_head: int
    """Where that head lands, local to the consumer rank."""
    num_heads: int


@dataclass(frozen=True, slots=True)
class TokenRun:
    """A run of tokens moved from one source block to one destination block."""

    src: int
    """Index into the transfer's source block list."""
    dst: int
    """Index into the destination block list."""
    src_token: int
    """First token of the run within the source block."""
    dst_token: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Why a producer cannot write into a consumer: the field, both values and the rule broken."""

    field: str
    producer: object
    consumer: object
    rule: str = "differs"

    def __str__(self) -> str:
        return f"{self.field} {self.rule}: producer {self.producer!r}, consumer {self.consumer!r}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_layout(layout: KvLayout) -> None:
    if layout.block_size < 0 or layout.num_layers < 0 or layout.num_kv_heads < 0:
        raise ShapeError("layout", "layout sizes must not be negative", agents=False)
    if layout.tp_size < 1 or layout.pp_size < 1:
        field = "tp_size" if layout.tp_size < 1 else "pp_size"
        raise ShapeError(field, "tp_size and pp_size must be >= 1", agents=False)
    if layout.num_kv_heads % layout.tp_size:
        raise ShapeError(
            "num_kv_heads",
            f"num_kv_heads {layout.num_kv_heads} is not a multiple of tp_size {layout.tp_size}",
            agents=False,
        )
    if layout.pp_size > 1 and not layout.num_layers:
        raise ShapeError("num_layers", "num_layers must be stated with pp_size > 1", agents=False)
    if layout.pp_size > max(layout.num_layers, 1):
        raise ShapeError("pp_size", f"pp_size {layout.pp_size} exceeds num_layers {layout.num_layers}", agents=False)


def _stage_layers(layout: KvLayout, agent: NixlAgent) -> range:
    if layout.pp_size == 1:
        if agent.first_layer or agent.num_layers not in (0, layout.num_layers):
            raise ShapeError(
                "num_layers",
                f"rank {agent.rank} holds layers [{agent.first_layer}, +{agent.num_layers}); with pp_size 1 every "
                f"rank holds all {layout.num_layers}",
                agents=True,
            )
        return range(layout.num_layers)
    if agent.num_layers < 1:
        raise ShapeError("num_layers", f"rank {agent.rank} states no layers (needed with pp_size > 1)", agents=True)
    return range(agent.first_layer, agent.first_layer + agent.num_layers)


def rank_shape(layout: KvLayout, agent: NixlAgent) -> RankShape:
    """What the rank of `agent` holds, from its own agent alone (a producer rank's writer knows no other).

    Raises `ShapeError` when the layout is invalid, the rank is outside it, or the agent's layers or regions
    do not fit it; `rank_shapes` also checks the ranks against each other.
    """
    _check_layout(layout)
    if not 0 <= agent.rank < layout.tp_size * layout.pp_size:
        raise ShapeError(
            "rank",
            f"agent {agent.name} has rank {agent.rank}; tp_size {layout.tp_size} x pp_size {layout.pp_size} "
            f"makes ranks 0..{layout.tp_size * layout.pp_size - 1}",
            agents=True,
        )
    pp_rank, tp_rank = divmod(agent.rank, layout.tp_size)
    layers = _stage_layers(layout, agent)
    count = len(agent.regions)
    grouped = bool(layers) and count % len(layers) == 0
    if layers and not grouped and layout.pp_size > 1:
        raise ShapeError(
            "regions",
            f"rank {agent.rank} has {count} regions for {len(layers)} layers; with pp_size > 1 the regions "
            "must be a whole number per layer",
            agents=True,
        )
    heads = layout.num_kv_heads // layout.tp_size if layout.num_kv_heads else 1
    return RankShape(
        rank=agent.rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        first_layer=layers.start if grouped else 0,
        num_layers=len(layers) if grouped else 0,
        first_head=tp_rank * heads,
        num_heads=heads,
        num_regions=count,
        regions_per_layer=count // len(layers) if grouped else count,
    )


def rank_shapes(layout: KvLayout, agents: Sequence[NixlAgent]) -> tuple[RankShape, ...]:
    """Every rank's share of the engine's KV, in rank order; raises `ShapeError` unless it adds up.

    There is one agent per rank (tp_size x pp_size; none at all is an error too), each rank once; the TP ranks
    of a stage hold the same layers and the stages hold consecutive ranges covering all layers; each agent's
    regions are a whole number per layer, the same number on every rank.
    """
    _check_layout(layout)
    ranks = layout.tp_size * layout.pp_size
    by_rank: dict[int, NixlAgent] = {}
    for agent in agents:
        if agent.rank >= ranks:
            raise ShapeError(
                "rank",
                f"agent {agent.name} has rank {agent.rank}; tp_size {layout.tp_size} x pp_size {layout.pp_size} "
                f"makes ranks 0..{ranks - 1}",
                agents=True,
            )
        if agent.rank in by_rank:
            raise ShapeError("rank", f"rank {agent.rank} is registered twice", agents=True)
        by_rank[agent.rank] = agent
    missing = [r for r in range(ranks) if r not in by_rank]
    if missing:
        raise ShapeError(
            "rank",
            f"rank {missing[0]} is missing: tp_size {layout.tp_size} x pp_size {layout.pp_size} needs {ranks} "
            f"agents, got {len(agents)}",
            agents=True,
        )
    shapes: list[RankShape] = []
    next_layer = 0
    for pp_rank in range(layout.pp_size):
        stage = [rank_shape(layout, by_rank[pp_rank * layout.tp_size + t]) for t in range(layout.tp_size)]
        layers = _stage_layers(layout, by_rank[stage[0].rank])
        for shape in stage[1:]:
            if _stage_layers(layout, by_rank[shape.rank]) != layers:
                raise ShapeError(
                    "first_layer",
                    f"ranks {stage[0].rank} and {shape.rank} of pipeline stage {pp_rank} hold different layers",
                    agents=True,
                )
        if layers.start != next_layer:
            raise ShapeError(
                "first_layer",
                f"pipeline stage {pp_rank} starts at layer {layers.start}; the stages before end at {next_layer}",
                agents=True,
            )
        next_layer = layers.stop
        shapes.extend(stage)
    grouped = [s for s in shapes if s.num_layers]
    for shape in grouped[1:]:
        if shape.regions_per_layer != grouped[0].regions_per_layer:
            raise ShapeError(
                "regions",
                f"rank {shape.rank} has {shape.regions_per_layer} regions per layer; rank {grouped[0].rank} has "
                f"{grouped[0].regions_per_layer}",
                agents=True,
            )
    if layout.num_layers and next_layer != layout.num_layers:
        raise ShapeError(
            "num_layers", f"the pipeline stages hold {next_layer} of the {layout.num_layers} layers", agents=True
        )
    return tuple(shapes)


_RATIO = "ratio unsupported (one must divide the other)"


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a KV dtype name ("float16", "bfloat16", ...); 0 when unknown."""
    return _ELEMENT_BYTES.get(dtype.removeprefix("torch."), 0)


def _divides(a: int, b: int) -> bool:
    small, large = sorted((a, b))
    return small > 0 and large % small == 0


def layout_mismatch(
    producer: KvLayout,
    producer_agents: Sequence[NixlAgent],
    consumer: KvLayout,
    consumer_agents: Sequence[NixlAgent],
) -> Mismatch | None:
    """Why the producer's KV cannot be written into the consumer's, or None if it can.

    Accepted, as vLLM's NixlConnector accepts: the same model, dtype, layers, head count and block layout;
    TP sizes where one divides the other (heads stated, and a head-addressable block layout when they differ);
    block sizes where one divides the other; any pipeline split; and KV regions whose unit (one token of one
    head) has the same size, region by region. Both engines' shapes must be valid (`rank_shapes`); agents are
    compared only when both engines published some.
    """
    # The fingerprint last: an opaque hash (vLLM's compatibility hash, connector/compat.py) also changes with the
    # dtype or the layers, and the field that names the difference says more.
    for name in ("dtype", "num_layers", "kv_layout", "num_kv_heads", "model_fingerprint"):
        p, c = getattr(producer, name), getattr(consumer, name)
        if p != c:
            return Mismatch(name, p, c)
    if producer.tp_size != consumer.tp_size:
        if not _divides(producer.tp_size, consumer.tp_size):
            return Mismatch("tp_size", producer.tp_size, consumer.tp_size, _RATIO)
        if not producer.num_kv_heads:
            return Mismatch("num_kv_heads", 0, 0, "must be stated when tp_size differs")
        if producer.kv_layout not in HEAD_SPLIT_LAYOUTS:
            rule = f"must be one of {', '.join(HEAD_SPLIT_LAYOUTS)} when tp_size differs"
            return Mismatch("kv_layout", producer.kv_layout, consumer.kv_layout, rule)
    if producer.block_size != consumer.block_size:
        if not _divides(producer.block_size, consumer.block_size):
            return Mismatch("block_size", producer.block_size, consumer.block_size, _RATIO)
        if producer.kv_layout not in TOKEN_SPLIT_LAYOUTS:
            rule = f"must be equal with kv_layout {producer.kv_layout!r} (its blocks do not split by token)"
            return Mismatch("block_size", producer.block_size, consumer.block_size, rule)
        if producer.kv_layout == HKTV and not element_bytes(producer.dtype):
            return Mismatch("dtype", producer.dtype, consumer.dtype, f"has no known element size (needed by {HKTV})")
    if not producer_agents or not consumer_agents:
        return None
    return _regions_mismatch(producer, producer_agents, consumer, consumer_agents)


def _unit_sizes(layout: KvLayout, shape: RankShape, agent: NixlAgent) -> list[int | None]:
    """Bytes of one token of one head per region (None where a block does not split evenly)."""
    per_block = shape.num_heads * max(layout.block_size, 1)
    return [r.block_length_bytes // per_block if r.block_length_bytes % per_block == 0 else None for r in agent.regions]


def _regions_mismatch(
    producer: KvLayout,
    producer_agents: Sequence[NixlAgent],
    consumer: KvLayout,
    consumer_agents: Sequence[NixlAgent],
) -> Mismatch | None:
    p_shapes, c_shapes = rank_shapes(producer, producer_agents), rank_shapes(consumer, consumer_agents)
    p_grouped, c_grouped = bool(p_shapes[0].num_layers), bool(c_shapes[0].num_layers)
    if p_grouped and c_grouped and p_shapes[0].regions_per_layer != c_shapes[0].regions_per_layer:
        return Mismatch("regions per layer", p_shapes[0].regions_per_layer, c_shapes[0].regions_per_layer)
    p_agents = {a.rank: a for a in producer_agents}
    c_agents = {a.rank: a for a in consumer_agents}
    for share in shares(p_shapes, c_shapes):
        p_units = _unit_sizes(producer, p_shapes[share.producer_rank], p_agents[share.producer_rank])
        c_units = _unit_sizes(consumer, c_shapes[share.consumer_rank], c_agents[share.consumer_rank])
        if len(share.producer_regions) != len(share.consumer_regions):
            return Mismatch("regions", len(share.producer_regions), len(share.consumer_regions), "differ in count")
        for i, j in zip(share.producer_regions, share.consumer_regions, strict=True):
            if p_units[i] is None or p_units[i] != c_units[j]:
                return Mismatch(
                    f"rank {share.producer_rank} region {i} bytes per token and head",
                    p_units[i],
                    c_units[j],
                    f"differ from consumer rank {share.consumer_rank} region {j}",
                )
    return None


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def shares(producer: Sequence[RankShape], consumer: Sequence[RankShape]) -> tuple[RankShare, ...]:
    """Every (producer rank, consumer rank) pair whose layers and heads overlap, with what moves between them.

    Each consumer rank's every (layer, head) is written by exactly one producer rank, so shares never overlap
    at the destination. Ranks that state no layers hold every region (pipeline size 1 on both sides).
    """
    out: list[RankShare] = []
    for p in producer:
        for c in consumer:
            heads = _overlap(p.heads, c.heads)
            if not heads:
                continue
            if p.num_layers and c.num_layers:
                layers = _overlap(p.layers, c.layers)
                if not layers:
                    continue
                p_regions, c_regions = p.region_range(layers), c.region_range(layers)
            else:
                p_regions, c_regions = range(p.num_regions), range(c.num_regions)
            out.append(
                RankShare(
                    producer_rank=p.rank,
                    consumer_rank=c.rank,
                    producer_regions=p_regions,
                    consumer_regions=c_regions,
                    producer_head=heads.start - p.first_head,
                    consumer_head=heads.start - c.first_head,
                    num_heads=len(heads),
                )
            )
    return tuple(out)


def token_runs(
    num_src: int,
    num_dst: int,
    producer_block_size: int,
    consumer_block_size: int,
    prompt_tokens: int = 0,
    target_tokens: int = 0,
) -> tuple[TokenRun, ...]:
    """Which tokens of which source block go to which destination block.

    Equal block sizes: the last `num_dst` source blocks go, whole, to the destination blocks in order (the
    token counts are not needed). Different block sizes: source block i holds tokens `[i * Bp, (i + 1) * Bp)` of
    a `prompt_tokens`-token prompt and the destination blocks receive its last `target_tokens` tokens, which
    must start on a destination block boundary and fill exactly `num_dst` blocks. Raises `BlockPairingError`.
    """
    bp, bd = producer_block_size, consumer_block_size
    if bp == bd:
        skip = num_src - num_dst
        if skip < 0:
            raise BlockPairingError(f"{num_dst} destination blocks but only {num_src} source blocks")
        return tuple(TokenRun(skip + j, j, 0, 0, bd) for j in range(num_dst))
    if bp < 1 or bd < 1:
        raise BlockPairingError(f"block sizes must be positive, got producer {bp} and consumer {bd}")
    if prompt_tokens < 1 or not 0 < target_tokens <= prompt_tokens:
        raise BlockPairingError(
            f"different block sizes need the token counts: prompt {prompt_tokens}, target {target_tokens}"
        )
    start = prompt_tokens - target_tokens
    if start % bd:
        raise BlockPairingError(f"the destination starts at token {start}, not on a {bd}-token block boundary")
    if _ceil_div(target_tokens, bd) != num_dst:
        filled = _ceil_div(target_tokens, bd)
        raise BlockPairingError(f"{target_tokens} tokens fill {filled} blocks of {bd}, not {num_dst}")
    if num_src < _ceil_div(prompt_tokens, bp):
        needed = _ceil_div(prompt_tokens, bp)
        raise BlockPairingError(f"{prompt_tokens} tokens need {needed} source blocks, got {num_src}")
    runs: list[TokenRun] = []
    token = start
    while token < prompt_tokens:
        end = min(prompt_tokens, (token // bp + 1) * bp, (token // bd + 1) * bd)
        dst = (token - start) // bd
        runs.append(TokenRun(token // bp, dst, token % bp, token % bd, end - token))
        token = end
    return tuple(runs)


def writers_into(producer: KvLayout, consumer: KvLayout, rank: RankShape) -> int:
    """How many producer ranks write into consumer rank `rank` (its heads come from tp_p / tp_c ranks when the
    producer has more TP ranks, its layers from every producer stage when it holds all layers); 0 when that
    depends on other ranks' layer ranges (pipeline parallel on both sides)."""
    heads = producer.tp_size // consumer.tp_size if producer.tp_size > consumer.tp_size else 1
    if producer.pp_size == 1:
        return heads
    all_layers = not rank.num_layers or rank.num_layers == consumer.num_layers
    return heads * producer.pp_size if all_layers else 0
