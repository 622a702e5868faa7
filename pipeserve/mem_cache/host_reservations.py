"""RAM shared by the pipeserve runs of one host: what each run has claimed, so a run that starts
beside others sizes itself to what they left instead of as if alone.

Pools are touched lazily (the kernel's MemAvailable does not fall when a run starts, only as
its pools fill), so two servers started one after the other would each take
--mem-fraction-static of RAM for a CPU device's pools and weights, and each a HiCache host
tier sized from the same MemAvailable, and meet the kernel's out-of-memory killer later. So a
run writes down, where it starts, the RAM it will fill (`Reservation`), and a later run counts
the claims of the runs still alive (`claimed_bytes`) as taken.

A claim is one small JSON file in a directory of the host (`envs.ram_claims_dir`:
PIPESERVE_RESERVATIONS_DIR, else under /dev/shm, else the temporary directory), named by the process
that holds it; it goes when the run shuts down (or is garbage-collected, or its process exits),
and a claim whose process is gone (killed) counts for nothing and is removed by the next
reader. Reading and writing hold one lock (fcntl), so runs starting together see each other.
Claims are per host: a multi-node run's other nodes are not counted here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeserve import envs

log = logging.getLogger(__name__)

SUFFIX = ".claim.json"


@contextmanager
def _locked() -> Iterator[Path]:
    folder = envs.ram_claims_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with
    the pid it names one process, though pids are reused; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass(frozen=True)
class Claim:
    pid: int
    nbytes: int
    what: str


def _live_claims(folder: Path) -> list[Claim]:
    """The claims of processes still running (under the lock); dead ones are removed."""
    claims = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            data = json.loads(path.read_text())
            pid, started = int(data["pid"]), str(data["started"])
            claim = Claim(pid, int(data["bytes"]), str(data.get("what", "")))
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # unreadable: no one can be holding it meaningfully
            continue
        if _start_time(pid) != started:
            path.unlink(missing_ok=True)
            continue
        claims.append(claim)
    return claims


def claimed_bytes() -> tuple[int, list[Claim]]:
    """Bytes of RAM the live pipeserve runs of this host have claimed, and their claims."""
    with _locked() as folder:
        claims = _live_claims(folder)
    return sum(c.nbytes for c in claims), claims


def describe(claims: list[Claim]) -> str:
    """'12.0 GiB by pid 41 (serve tiny-llama), ...' for a message, the largest first."""
    ordered = sorted(claims, key=lambda c: -c.nbytes)
    return ", ".join(f"{c.nbytes / 2**30:.1f} GiB by pid {c.pid} ({c.what})" for c in ordered)


class Reservation:
    """This run's claim of `nbytes` of RAM, held until `release` (or until the object is
    collected, or the process exits)."""

    def __init__(self, nbytes: int, what: str) -> None:
        pid = os.getpid()
        started = _start_time(pid) or "?"
        with _locked() as folder:
            self.path = folder / f"{pid}-{uuid.uuid4().hex[:12]}{SUFFIX}"
            data = {"pid": pid, "started": started, "bytes": nbytes, "what": what}
            self.path.write_text(json.dumps(data))
        self._finalizer = weakref.finalize(self, self.path.unlink, missing_ok=True)
        log.debug("claimed %.1f GiB of host RAM (%s)", nbytes / 2**30, self.path)

    def release(self) -> None:
        self._finalizer()
