"""Which layers each pipeline stage owns."""

from __future__ import annotations


def default_partition(num_layers: int, pp_size: int) -> list[int]:
    """`num_layers // pp_size` each; the last `num_layers % pp_size` stages get one more
    (61 layers on 4 stages: 15,15,15,16) — later stages then wait less for earlier ones."""
    if num_layers < pp_size:
        raise ValueError(f"cannot split {num_layers} layers over --pp-size {pp_size} stages")
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if stage >= pp_size - extra else 0) for stage in range(pp_size)]


def parse_partition(spec: str, num_layers: int, pp_size: int) -> list[int]:
    """A user's comma-separated layers-per-stage list, validated."""
    try:
        parts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"--pp-layer-partition {spec!r} must be a comma-separated list of integers"
        ) from None
    if len(parts) != pp_size:
        raise ValueError(
            f"--pp-layer-partition {spec} has {len(parts)} parts but --pp-size is {pp_size}"
        )
    if any(p <= 0 for p in parts):
        raise ValueError(f"--pp-layer-partition {spec}: every stage needs at least one layer")
    if sum(parts) != num_layers:
        raise ValueError(
            f"--pp-layer-partition {spec} sums to {sum(parts)} but the model has {num_layers} layers"
        )
    return parts


def stage_ranges(partition: list[int]) -> list[range]:
    starts = [sum(partition[:i]) for i in range(len(partition))]
    return [range(s, s + n) for s, n in zip(starts, partition, strict=True)]


def resolve_partition(spec: str | None, num_layers: int, pp_size: int) -> list[int]:
    """The partition to use: the user's list if given, else the default rule."""
    if spec is None:
        return default_partition(num_layers, pp_size)
    return parse_partition(spec, num_layers, pp_size)
