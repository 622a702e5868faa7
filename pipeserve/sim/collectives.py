"""Communication times from volumes (spec 06): a message costs latency + bytes / bandwidth on
its link; collectives by their ring formulas. `size` is the whole tensor a rank holds."""

from __future__ import annotations

from pipeserve.sim.hardware import Link


def p2p_s(nbytes: float, link: Link) -> float:
    """One point-to-point message."""
    return link.latency + nbytes / (link.bandwidth * link.efficiency)


def ring_all_reduce_s(size: float, ranks: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): each rank sends 2(N-1)/N of the
    tensor in 2(N-1) steps."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency + 2 * (ranks - 1) / ranks * size / (
        link.bandwidth * link.efficiency
    )


def ring_all_gather_s(size: float, ranks: int, link: Link) -> float:
    """Ring all-gather of a tensor of `size` bytes in total (each rank holds size / N): each
    rank receives (N-1)/N of it in N-1 steps."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency + (ranks - 1) / ranks * size / (
        link.bandwidth * link.efficiency
    )


def all_to_all_s(sent: float, ranks: int, link: Link) -> float:
    """All-to-all where a rank sends `sent` bytes to the others in all (the busiest rank's):
    one message per peer, the bytes through the rank's link."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency + sent / (link.bandwidth * link.efficiency)


def pp_send_bytes(tokens: int, hidden: int, act_bytes: float, residual: bool = True) -> float:
    """What crosses a pipeline boundary per micro-batch: hidden states (and the residual,
    which travels with them in this design), [tokens, hidden] each."""
    return tokens * hidden * act_bytes * (2 if residual else 1)
