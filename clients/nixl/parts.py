"""Progressive push: which cells of a target a writer may post before the prompt is fully computed.

A producer rank sees a transfer's target as a grid of cells, (target block, layer column): a column is one
of the rank's layers (its `regions_per_layer` regions, `kvmap.rank_shape`), or all its regions when they are
not grouped by layer (then only parts of all layers can be placed). The engine reports what it computed
(`Computed`: per column, how many of the prompt's first tokens, and the prompt's blocks so far); a target block
is ready in a column once every token it receives is computed there (`Grid`), so a partly computed block waits
for the next part or the final write and blocks keep their equal-size fast path. Block sizes that differ pair
tokens as `kvmap.token_runs` says: a target block then also waits for the source blocks its tokens come from.

Per column the cells posted are always a prefix of the target's blocks, so what is new is one range of blocks
per column, and neighbouring columns with the same range form one rectangle (`rectangles`), reported in target
coordinates as a `WrittenPart`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rendezvous.protocol import kvmap
from rendezvous.protocol.records import KvLayout, NixlAgent, WrittenPart

__all__ = ["Columns", "Computed", "Grid", "Rectangle", "WrittenPart", "rectangles"]

_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Rectangle:
    """Target blocks `[first_block, end_block)` in columns `[first_column, end_column)`."""

    first_block: int
    end_block: int
    first_column: int
    end_column: int


@dataclass(frozen=True, slots=True)
class Columns:
    """A producer rank's regions as layer columns."""

    first_layer: int
    """The model layer of column 0."""
    count: int
    regions_per_column: int
    by_layer: bool
    """Columns are layers; else one column holds every region and parts of some layers cannot be placed."""
    all_layers: bool
    """The rank holds every layer of the model (parts of all columns are reported as all layers)."""

    @classmethod
    def of(cls, layout: KvLayout | None, agent: NixlAgent) -> Columns:
        """The columns of the rank of `agent` in `layout` (one column when unknown)."""
        if layout is not None:
            try:
                shape = kvmap.rank_shape(layout, agent)
            except kvmap.ShapeError:
                shape = None
            if shape is not None and shape.num_layers:
                all_layers = shape.num_layers == layout.num_layers
                return cls(shape.first_layer, shape.num_layers, shape.regions_per_layer, True, all_layers)
        return cls(0, 1, len(agent.regions), False, True)

    def select(self, layers: tuple[int, int] | None) -> slice | None:
        """The columns of model layers `[first, end)` (None = all); None when they hold none of them."""
        if layers is None:
            return slice(0, self.count)
        if not self.by_layer:
            return None
        first, end = max(layers[0] - self.first_layer, 0), min(layers[1] - self.first_layer, self.count)
        return slice(first, end) if first < end else None

    def regions(self, first: int, end: int) -> range:
        """The rank's region indices of columns `[first, end)`."""
        return range(first * self.regions_per_column, end * self.regions_per_column)

    def layers_of(self, regions: range) -> range | None:
        """The model layers of the rank's `regions` (whole columns); None when columns are not layers."""
        if not self.by_layer:
            return None
        per = self.regions_per_column
        return range(self.first_layer + regions.start // per, self.first_layer + -(-regions.stop // per))

    def within(self, part: WrittenPart, layers: range | None) -> WrittenPart | None:
        """`part` cut to model `layers` (None: columns are not layers, so parts are of all of them), with its
        layers stated; None when it has none of them."""
        if layers is None:
            return part
        first = part.first_layer if part.num_layers else self.first_layer
        stop = first + (part.num_layers or self.count)
        first, stop = max(first, layers.start), min(stop, layers.stop)
        return WrittenPart(part.first_token, part.num_tokens, first, stop - first) if first < stop else None

    def part(self, r: Rectangle, grid: Grid) -> WrittenPart:
        """`r` in target coordinates."""
        first_token = r.first_block * grid.consumer_block_size
        num_tokens = min(r.end_block * grid.consumer_block_size, grid.tokens) - first_token
        if self.all_layers and r.first_column == 0 and r.end_column == self.count:
            return WrittenPart(first_token, num_tokens, 0, 0)
        return WrittenPart(first_token, num_tokens, self.first_layer + r.first_column, r.end_column - r.first_column)


@dataclass(eq=False)
class Computed:
    """What the engine reported computed for a transfer so far (`TransferWriter.source_part`)."""

    src: _Ints
    """The prompt's source blocks so far, in order (the longest list reported)."""
    tokens: _Ints
    """Per column, how many of the prompt's first tokens are computed."""
    prompt_tokens: int = 0
    """The prompt's length, 0 while unknown."""

    @classmethod
    def empty(cls, columns: Columns) -> Computed:
        return cls(np.zeros(0, dtype=np.int64), np.zeros(columns.count, dtype=np.int64))

    def restarted(self, src: _Ints, num_tokens: int, columns: slice | None) -> bool:
        """Whether a report is of the prompt computed again from its first token (vLLM preempted it and resumed it
        in other blocks): its blocks do not continue those reported, or fewer tokens are computed where more were."""
        known = min(len(src), len(self.src))
        if not np.array_equal(src[:known], self.src[:known]):
            return True
        return columns is not None and bool((self.tokens[columns] > num_tokens).any())

    def add(self, src: _Ints, num_tokens: int, columns: slice | None, prompt_tokens: int) -> None:
        if len(src) > len(self.src):
            self.src = src
        if columns is not None:
            self.tokens[columns] = np.maximum(self.tokens[columns], num_tokens)
        self.prompt_tokens = max(self.prompt_tokens, prompt_tokens)


@dataclass(frozen=True, slots=True)
class Grid:
    """A target's blocks placed in a prompt of known length."""

    start: int
    """The prompt token that is the target's first."""
    tokens: int
    """The target's tokens (the prompt's last ones)."""
    ends: _Ints
    """Per target block, the prompt token after the last one it receives."""
    producer_block_size: int
    consumer_block_size: int
    runs: tuple[kvmap.TokenRun, ...] | None
    """How tokens pair with different block sizes; None for equal ones (target block j takes source block
    `start // block_size + j` whole)."""

    @classmethod
    def of(cls, num_dst: int, bp: int, bd: int, prompt_tokens: int, target_tokens: int) -> Grid:
        """Raises `kvmap.BlockPairingError` when the target does not fit the prompt."""
        num_src = -(-prompt_tokens // bp)
        runs = None
        if bp == bd:
            if num_src < num_dst:
                raise kvmap.BlockPairingError(f"{num_dst} target blocks but the prompt fills {num_src}")
            start = (num_src - num_dst) * bd
            if target_tokens and target_tokens != prompt_tokens - start:  # the parts name the target's tokens
                raise kvmap.BlockPairingError(
                    f"a target of {target_tokens} tokens is not the last {num_dst} blocks of a {prompt_tokens}-token"
                    " prompt"
                )
        else:
            runs = kvmap.token_runs(num_src, num_dst, bp, bd, prompt_tokens, target_tokens)
            start = prompt_tokens - target_tokens
        tokens = prompt_tokens - start
        ends = start + np.minimum(np.arange(1, num_dst + 1, dtype=np.int64) * bd, tokens)
        return cls(start, tokens, ends, bp, bd, runs)

    @property
    def num_src(self) -> int:
        """Source blocks the whole prompt fills."""
        return -(-(self.start + self.tokens) // self.producer_block_size)

    def ready(self, computed: Computed) -> _Ints:
        """Per column, how many of the target's first blocks are computed, with their source blocks known."""
        limit = np.minimum(computed.tokens, len(computed.src) * self.producer_block_size)
        return np.searchsorted(self.ends, limit, side="right").astype(np.int64)

    def runs_of(self, r: Rectangle) -> list[kvmap.TokenRun]:
        assert self.runs is not None
        return [run for run in self.runs if r.first_block <= run.dst < r.end_block]


def rectangles(posted: _Ints, ready: _Ints) -> list[Rectangle]:
    """The cells ready but not posted, per column blocks `[posted, ready)`, as rectangles of neighbouring columns
    alike. One pass over the columns as Python ints: for the few dozen columns of a rank, faster than numpy's
    calls on arrays that small."""
    found: list[list[int]] = []  # [first_block, end_block, first_column, end_column]
    for column, (first, end) in enumerate(zip(posted.tolist(), ready.tolist(), strict=True)):
        if first >= end:
            continue
        last = found[-1] if found else None
        if last is not None and last[3] == column and last[0] == first and last[1] == end:
            last[3] = column + 1
        else:
            found.append([first, end, column, column + 1])
    return [Rectangle(*cell) for cell in found]
