"""Which layers each pipeline stage owns."""

from __future__ import annotations

from collections.abc import Callable


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
            f"--pp-layer-partition {spec} sums to {sum(parts)} "
            f"but the model has {num_layers} layers"
        )
    return parts


def stage_ranges(partition: list[int]) -> list[range]:
    starts = [sum(partition[:i]) for i in range(len(partition))]
    return [range(s, s + n) for s, n in zip(starts, partition, strict=True)]


def resolve_partition(
    spec: str | None,
    num_layers: int,
    pp_size: int,
    measure: Callable[[], tuple[list[float], float, float]] | None = None,
) -> list[int]:
    """The partition to use: the user's list, 'auto' (balanced on measured costs: per-layer,
    embedding, output head), or the default rule."""
    if spec is None:
        return default_partition(num_layers, pp_size)
    if spec.strip().lower() == "auto":
        if measure is None:
            raise ValueError("--pp-layer-partition auto needs a layer cost measurement")
        per_layer, embed, head = measure()
        return balanced_partition(per_layer, pp_size, first_extra=embed, last_extra=head)
    return parse_partition(spec, num_layers, pp_size)


def balanced_partition(
    layer_costs: list[float], pp_size: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Contiguous split of the layers into `pp_size` non-empty stages that minimises the
    slowest stage (stage 0 also pays `first_extra`, e.g. the embedding; the last stage
    `last_extra`, e.g. the final norm and LM head); among those, the most even one (least sum
    of squared stage costs); among those, later stages get as many layers as possible. For
    equal layer costs this is the default rule (61 layers on 4 stages: 15,15,15,16)."""
    n = len(layer_costs)
    if n < pp_size:
        raise ValueError(f"cannot split {n} layers over --pp-size {pp_size} stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(lo: int, hi: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == pp_size - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    def splits(k: int, j: int) -> range:  # where stage k-1 may start if it ends at j
        return range(k - 1, j)

    inf = float("inf")
    eps = 1e-9 * (prefix[-1] + abs(first_extra) + abs(last_extra)) + 1e-15
    # bottleneck[k][j]: least possible slowest-stage cost of layers [0, j) on stages 0..k-1
    bottleneck = [[inf] * (n + 1) for _ in range(pp_size + 1)]
    bottleneck[0][0] = 0.0
    for k in range(1, pp_size + 1):
        for j in range(k, n + 1):
            bottleneck[k][j] = min(
                max(bottleneck[k - 1][i], cost(i, j, k - 1)) for i in splits(k, j)
            )
    limit = bottleneck[pp_size][n] + eps
    # squares[k][j]: least sum of squared stage costs with every stage within the limit
    squares = [[inf] * (n + 1) for _ in range(pp_size + 1)]
    squares[0][0] = 0.0
    for k in range(1, pp_size + 1):
        for j in range(k, n + 1):
            squares[k][j] = min(
                (
                    squares[k - 1][i] + cost(i, j, k - 1) ** 2
                    for i in splits(k, j)
                    if cost(i, j, k - 1) <= limit
                ),
                default=inf,
            )
    sizes, hi, left = [], n, squares[pp_size][n]
    for k in range(pp_size, 0, -1):  # from the last stage: the most layers that stay optimal
        lo = next(
            i
            for i in splits(k, hi)
            if cost(i, hi, k - 1) <= limit
            and abs(squares[k - 1][i] + cost(i, hi, k - 1) ** 2 - left) <= eps * (1 + left)
        )
        left -= cost(lo, hi, k - 1) ** 2
        sizes.append(hi - lo)
        hi = lo
    return sizes[::-1]


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[first, end) of the KV heads a TP rank holds: an even share when there are at least as
    many heads as ranks, else one head replicated over tp_size / num_kv_heads ranks."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    first = tp_rank * num_kv_heads // tp_size
    return first, first + 1
