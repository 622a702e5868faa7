"""Child processes that do not outlive their parent.

A worker or engine process asks the kernel to kill it when its parent dies (Linux
`PR_SET_PDEATHSIG`; the signal comes when the thread that started the child exits, so
children are started from a long-lived thread). A child forked by multiprocessing's fork
server (workers: distributed/launcher.py) has the server as its OS parent, which outlives
the process that asked for it, and one without prctl: a thread watches the logical
parent's pid instead (a pidfd where Linux has one, else polling). Both also catch a parent
that died before the call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
POLL_S = 0.2
WORKER_NAME = "pipeserve-w"  # + the rank: a worker's name in ps, top and /proc/PID/comm
REFUSED_EXIT = 2  # a worker whose start-up checks refused its settings (it sent why first)


def name_process(name: str) -> None:
    """The name ps and top show for this process (Linux: its first 15 bytes; elsewhere
    nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def exit_with_parent() -> None:
    """Make this process (started by multiprocessing) end when its parent goes away."""
    parent = mp.parent_process()
    if parent is None or parent.pid is None:
        return
    parent_pid = parent.pid
    if os.getppid() == parent_pid and _set_parent_death_signal():
        if os.getppid() != parent_pid:  # it died before we asked
            os._exit(1)
        return
    threading.Thread(target=_watch_pid, args=(parent_pid,), daemon=True).start()


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; watching the parent pid instead")
        return False


def _watch_pid(pid: int) -> None:
    """Exit as soon as process `pid` has (at once if it already has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds here: poll
        while _alive(pid):
            time.sleep(POLL_S)
        os._exit(1)
    select.select([fd], [], [])  # readable once the process has exited
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
