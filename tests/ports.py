"""Free TCP ports for tests, taken from below the kernel's ephemeral range.

A port that `bind(0)` hands out lies inside the ephemeral range, where two things can take it
between the check and the test's own bind: any outgoing connection of this machine, and, worse,
the test's own client. A client retrying a connect to a port with no listener yet can be given
that same port as its source port, and Linux then completes the connection to itself (TCP
simultaneous open), so the listener that starts a moment later fails with "address already in
use". Ports below the ephemeral range are never chosen as source ports.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the well-known and most registered service ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port p such that p .. p + span - 1 are all free now and none is ephemeral."""
    high = ephemeral_low() - span
    if high <= LOWEST:
        raise RuntimeError(f"no room for {span} ports below the ephemeral range")
    for _ in range(200):
        base = random.randrange(LOWEST, high)
        if all(port_free(base + i) for i in range(span)):
            return base
    raise RuntimeError(f"no {span} consecutive free ports found")
