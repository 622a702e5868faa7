"""Child processes that do not outlive their parent.

A worker or engine process asks the kernel to kill it when its parent dies (Linux
`PR_SET_PDEATHSIG`; the signal comes when the thread that started the child exits, so
children are started from a long-lived thread). Where that is not available, a thread
watches the parent's pid instead. Both also catch a parent that died before the call.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
POLL_S = 0.2


def exit_with_parent() -> None:
    """Make this process (started by multiprocessing) end when its parent goes away."""
    parent = mp.parent_process()
    if parent is None or parent.pid is None:
        return
    parent_pid = parent.pid
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # it died before we asked
        os._exit(1)


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; watching the parent pid instead")
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os._exit(1)
