"""Child processes that do not outlive the process that started them.

Why: `pdproxy demo` starts servers, and whatever way it ends (Ctrl-C, SIGTERM, an error, SIGKILL)
nothing it started may keep running. Each child gets a session of its own, so a terminal's Ctrl-C
reaches only the parent (which stops its children in order) and a signal to the child's group also
reaches anything the child started. On Linux the kernel also sends the child SIGKILL when its parent
dies (PR_SET_PDEATHSIG), the one case where no handler of the parent can run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Any:
    """libc's prctl, looked up in the parent: a forked child should not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """In a child just forked from `parent` (its pid): have the kernel send `signum` to it when the parent
    dies, and if the parent already died between the fork and now, die at once. Linux only; elsewhere a no-op.

    The kernel tracks the *thread* that forked: the child also gets `signum` when that thread ends, so
    start long-lived children from a thread that lives as long as the process (`spawn` does so only from the
    main thread)."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def spawn(args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen in a session of its own that dies with this process (from the main thread)."""
    if threading.current_thread() is threading.main_thread() and _prctl is not None:
        parent = os.getpid()
        popen_kwargs["preexec_fn"] = lambda: die_with_parent(parent)
    return subprocess.Popen(args, start_new_session=True, **popen_kwargs)


def signal_group(popen: subprocess.Popen, signum: int) -> None:
    """`signum` to the child's whole process group (it may have started processes of its own); a child already
    reaped is left alone, since its pid may have been reused."""
    if popen.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signum)


class Group:
    """Children stopped together: SIGTERM to every one at once, a grace period for all of them together (so
    stopping takes as long as the slowest child, not the sum), then SIGKILL, and every one reaped."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []

    def spawn(self, args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        popen = spawn(args, **popen_kwargs)
        self.popens.append(popen)
        return popen

    def signal(self, signum: int) -> None:
        for popen in reversed(list(self.popens)):
            signal_group(popen, signum)

    def kill_after(self, grace: float) -> None:
        """Wait up to `grace` seconds for every child to exit, SIGKILL the groups still running, reap them all.
        Safe to call from another thread while the main thread does the same."""
        deadline = time.monotonic() + grace
        try:
            for popen in reversed(list(self.popens)):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(max(0.0, deadline - time.monotonic()))
        finally:  # even when interrupted: nothing is left running, nothing unreaped
            self.signal(signal.SIGKILL)
            for popen in list(self.popens):
                popen.wait()

    def stop(self, grace: float) -> None:
        """SIGTERM, up to `grace` seconds, SIGKILL; returns when every child is reaped."""
        self.signal(signal.SIGTERM)
        self.kill_after(grace)
        self.popens.clear()
