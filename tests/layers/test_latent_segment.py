"""A latent segment given by its runs of slots alone is the segment of its explicit slots:
the same slots, new slots, slots at chosen positions, rows read and parts."""

from __future__ import annotations

import pytest
import torch

from pipeserve.layers.latent_segment import LatentSegment

RUNS = {
    "one run": ((40, 20),),
    "scattered": ((100, 5), (10, 3), (50, 12)),
    "new tokens across two runs": ((100, 18), (7, 2)),
}


def explicit(runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.tensor([start + i for start, n in runs for i in range(n)])


@pytest.mark.parametrize("runs", list(RUNS.values()), ids=list(RUNS))
@pytest.mark.parametrize("q_len", [1, 3])
def test_runs_alone_give_the_explicit_segment(runs: tuple[tuple[int, int], ...], q_len: int):
    slots = explicit(runs)
    given, lazy = LatentSegment(2, q_len, slots), LatentSegment(2, q_len, runs=runs)
    assert lazy.length == given.length == slots.shape[0]
    assert lazy.prefix_len == given.prefix_len == slots.shape[0] - q_len
    assert lazy.new_slots.tolist() == slots[-q_len:].tolist()
    positions = torch.tensor([[0, 5], [slots.shape[0] - 1, 3]])
    assert lazy.slots_at(positions).tolist() == slots[positions].tolist()
    cache = torch.randn(200, 4)
    with_runs = LatentSegment(2, q_len, slots, runs=runs)  # the engine's device-path form
    for seg in (lazy, with_runs):
        assert torch.equal(seg.read(cache), cache[slots])
        assert sorted(map(tuple, torch.cat(seg.parts(cache)).tolist())) == sorted(
            map(tuple, cache[slots].tolist())
        )
    assert lazy.slots.tolist() == slots.tolist()


def test_a_segment_needs_its_slots_or_their_runs() -> None:
    with pytest.raises(ValueError, match="slots or their runs"):
        LatentSegment(0, 1)
