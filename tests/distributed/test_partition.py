"""Pipeline layer partition: default split and validation of a user's split."""

from __future__ import annotations

import pytest

from pipeserve.distributed.partition import default_partition, parse_partition, stage_ranges


@pytest.mark.parametrize(
    ("num_layers", "pp_size", "expected"),
    [
        (61, 4, [15, 15, 15, 16]),
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [2, 2, 3, 3]),  # the extra layers go to the last stages
        (7, 1, [7]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_default_partition(num_layers: int, pp_size: int, expected: list[int]) -> None:
    assert default_partition(num_layers, pp_size) == expected


def test_default_partition_is_balanced_and_non_decreasing() -> None:
    for num_layers in range(1, 40):
        for pp_size in range(1, num_layers + 1):
            parts = default_partition(num_layers, pp_size)
            assert len(parts) == pp_size and sum(parts) == num_layers
            assert parts == sorted(parts) and parts[-1] - parts[0] <= 1


def test_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot split 3 layers over --pp-size 4 stages"):
        default_partition(3, 4)


def test_parse_partition_accepts_a_valid_split() -> None:
    assert parse_partition("15,15,15,16", 61, 4) == [15, 15, 15, 16]
    assert parse_partition(" 20, 41", 61, 2) == [20, 41]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("16,15,15", "--pp-layer-partition 16,15,15 has 3 parts but --pp-size is 4"),
        ("15,15,x,16", "'15,15,x,16' must be a comma-separated list of integers"),
        ("", "must be a comma-separated list of integers"),
        ("31,0,15,15", "31,0,15,15: every stage needs at least one layer"),
        ("32,-1,15,15", "every stage needs at least one layer"),
        ("15,15,15,15", "15,15,15,15 sums to 60 but the model has 61 layers"),
    ],
)
def test_parse_partition_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_partition(spec, 61, 4)


def test_stage_ranges() -> None:
    assert stage_ranges([15, 15, 15, 16]) == [
        range(0, 15), range(15, 30), range(30, 45), range(45, 61)
    ]
    assert stage_ranges([4]) == [range(0, 4)]
