"""Expert -> rank placement: contiguous blocks (even and uneven), an explicit table, and the
errors for placements that cannot work."""

from __future__ import annotations

import pytest
import torch

from pipeserve.moe.dispatcher.placement import ExpertPlacement


def test_contiguous_blocks() -> None:
    p = ExpertPlacement.contiguous(8, 4)
    assert p.rank_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert p.local_index == (0, 1, 0, 1, 0, 1, 0, 1)
    assert p.experts_on(2) == (4, 5)


def test_uneven_blocks_give_the_first_ranks_one_more() -> None:
    p = ExpertPlacement.contiguous(7, 3)
    assert [p.experts_on(r) for r in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]
    assert p.local_index == (0, 1, 2, 0, 1, 0, 1)


def test_table_numbers_local_experts_in_global_order() -> None:
    p = ExpertPlacement.from_table([1, 0, 1, 1, 0], 2)
    assert p.experts_on(0) == (1, 4) and p.experts_on(1) == (0, 2, 3)
    assert p.local_index == (0, 0, 1, 2, 1)
    assert p.num_experts == 5


def test_lookup_rows_are_rank_and_local_index() -> None:
    p = ExpertPlacement.from_table([1, 0, 1], 2)
    assert torch.equal(p.lookup(torch.device("cpu")), torch.tensor([[1, 0, 1], [0, 0, 1]]))


def test_bad_placements_are_refused() -> None:
    with pytest.raises(ValueError, match="expert 2 on rank 2"):
        ExpertPlacement.from_table([0, 1, 2], 2)
    with pytest.raises(ValueError, match="3 experts cannot be spread"):
        ExpertPlacement.contiguous(3, 4)
