"""The overlap loop's future token map: ring slots handed out in order (never slot 0, so
every placeholder is negative) and placeholders resolved to the tokens stored in them."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine.future_map import FutureMap, SlotRing, ring_size

CPU = torch.device("cpu")


def test_reserve_hands_out_consecutive_slots_from_1() -> None:
    ring = SlotRing(8)
    assert ring.reserve(3) == [1, 2, 3]
    assert ring.reserve(2) == [4, 5]
    assert ring.reserve(0) == []
    assert ring.reserve(1) == [6]


def test_reserve_wraps_around_skipping_slot_0() -> None:
    ring = SlotRing(4)  # usable slots 1, 2, 3
    assert ring.reserve(2) == [1, 2]
    assert ring.reserve(2) == [3, 1]
    assert ring.reserve(3) == [2, 3, 1]  # a full ring at once, still no 0
    assert ring.reserve(1) == [2]


def test_smallest_ring_reuses_its_one_slot() -> None:
    ring = SlotRing(2)
    assert [ring.reserve(1) for _ in range(3)] == [[1], [1], [1]]


def test_too_many_placeholders_are_rejected() -> None:
    ring = SlotRing(4)
    with pytest.raises(ValueError, match="4 placeholders do not fit a ring of 3 slots"):
        ring.reserve(4)
    assert ring.reserve(1) == [1]  # a rejected reservation takes nothing


@pytest.mark.parametrize("size", [0, 1])
def test_ring_needs_two_slots(size: int) -> None:
    with pytest.raises(ValueError, match="at least 2 slots"):
        SlotRing(size)


def test_resolve_replaces_placeholders_and_keeps_real_ids() -> None:
    fm = FutureMap(6, CPU)
    fm.store(torch.tensor([1, 3, 5]), torch.tensor([101, 303, 505]))
    ids = torch.tensor([7, -1, 0, -3, 511, -5, 2])
    out = fm.resolve(ids)
    assert out.tolist() == [7, 101, 0, 303, 511, 505, 2]
    assert out.dtype == torch.long
    assert ids.tolist() == [7, -1, 0, -3, 511, -5, 2]  # input untouched


def test_store_overwrites_a_slot_on_reuse() -> None:
    fm = FutureMap(3, CPU)
    slots = torch.tensor(fm.reserve(2))
    fm.store(slots, torch.tensor([10, 20]))
    assert fm.resolve(torch.tensor([-1, -2])).tolist() == [10, 20]
    again = torch.tensor(fm.reserve(1))  # wrapped around to slot 1
    assert again.tolist() == [1]
    fm.store(again, torch.tensor([30]))
    assert fm.resolve(torch.tensor([-1, -2, 4])).tolist() == [30, 20, 4]


def test_resolve_of_ids_without_placeholders_is_identity() -> None:
    fm = FutureMap(4, CPU)
    ids = torch.arange(0, 50)  # ids far beyond the ring size are not slots
    assert torch.equal(fm.resolve(ids), ids)


def test_ring_size_has_room_for_every_chunk_in_flight() -> None:
    assert ring_size(max_running_requests=4, context_len=100, chunk_size=32) == 4 * (3 + 4) + 1
    assert ring_size(max_running_requests=4, context_len=100, chunk_size=None) == 4 * 4 + 1
