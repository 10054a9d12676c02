"""Where parts go: target blocks placed in the prompt (`Grid`), layer columns, rectangles of new cells."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous.clients._types import KvLayout, KvRegion, NixlAgentInfo
from rendezvous.clients.nixl.parts import Columns, Computed, Grid, Rectangle, WrittenPart, rectangles
from rendezvous.protocol.kvmap import BlockPairingError

AGENT = NixlAgentInfo("a", b"", regions=tuple(KvRegion(4096 * i, 64, 64, 8) for i in range(4)))


def computed(tokens: list[int], num_src: int) -> Computed:
    return Computed(np.arange(num_src, dtype=np.int64), np.array(tokens, dtype=np.int64))


def test_equal_blocks_take_the_prompts_last_blocks_and_wait_until_all_their_tokens_are_computed() -> None:
    grid = Grid.of(3, 4, 4, 18, 0)  # 5 blocks of 4; the consumer holds the first 2

    assert (grid.start, grid.tokens, grid.num_src, grid.ends.tolist()) == (8, 10, 5, [12, 16, 18])
    assert grid.ready(computed([11, 12, 17, 18], 5)).tolist() == [0, 1, 2, 3]
    assert grid.ready(computed([18], 4)).tolist() == [2]  # block 2's source block is not known yet


def test_a_target_whose_tokens_are_not_the_prompts_last_blocks_is_refused() -> None:
    assert Grid.of(3, 4, 4, 18, 10).tokens == 10
    with pytest.raises(BlockPairingError):
        Grid.of(3, 4, 4, 18, 12)
    with pytest.raises(BlockPairingError):
        Grid.of(6, 4, 4, 18, 0)


def test_bigger_consumer_blocks_pair_by_token_runs() -> None:
    grid = Grid.of(2, 16, 32, 80, 48)

    assert (grid.start, grid.ends.tolist()) == (32, [64, 80])
    assert grid.ready(computed([64], 4)).tolist() == [1]
    assert grid.ready(computed([64], 3)).tolist() == [0]
    assert {run.src for run in grid.runs_of(Rectangle(0, 1, 0, 1))} == {2, 3}


def test_new_cells_form_rectangles_of_columns_with_the_same_blocks() -> None:
    posted, ready = np.array([0, 0, 2, 2, 1]), np.array([3, 3, 3, 2, 1])

    assert rectangles(posted, ready) == [Rectangle(0, 3, 0, 2), Rectangle(2, 3, 2, 3)]


def test_columns_are_layers_and_parts_of_all_of_them_name_all_layers() -> None:
    columns = Columns.of(KvLayout("m", "u8", 4, 2, kv_layout="HND"), AGENT)
    grid = Grid.of(3, 4, 4, 18, 0)

    assert (columns.count, columns.regions_per_column, columns.by_layer) == (2, 2, True)
    assert columns.select((1, 2)) == slice(1, 2) and columns.select((5, 6)) is None
    assert columns.regions(1, 2) == range(2, 4)
    assert columns.part(Rectangle(1, 3, 0, 2), grid) == WrittenPart(4, 6, 0, 0)
    assert columns.part(Rectangle(0, 1, 1, 2), grid) == WrittenPart(0, 4, 1, 1)


def test_without_a_layout_one_column_holds_every_region_and_takes_no_layer_parts() -> None:
    columns = Columns.of(None, AGENT)

    assert (columns.count, columns.regions_per_column, columns.by_layer) == (1, 4, False)
    assert columns.select(None) == slice(0, 1) and columns.select((0, 1)) is None
