"""pdproxy/children.py: a group of children stops within its grace period, whatever they do, and nothing
it started outlives it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from pdproxy.children import Group
from procs import running
from waits import scaled, wait_until

# Ignores SIGTERM, starts a grandchild in its group that does too, writes the grandchild's pid, then sleeps.
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(600)
"""


def test_stop_kills_what_ignores_sigterm_and_what_it_started(tmp_path: Path) -> None:
    group = Group()
    files = [tmp_path / f"grandchild-{i}" for i in range(2)]
    popens = [group.spawn([sys.executable, "-c", STUBBORN, str(f)]) for f in files]
    try:
        grandchildren = [int(wait_until(lambda f=f: f.exists() and f.read_text(), f"{f.name}'s pid", timeout=20))
                         for f in files]
        t0 = time.monotonic()
        group.stop(grace=1.0)
        took = time.monotonic() - t0
    finally:
        for p in popens:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.returncode == -signal.SIGKILL for p in popens)  # reaped, after SIGTERM did nothing
    assert 1.0 <= took < scaled(5), took  # one grace period for all of them, not one each
    wait_until(lambda: not any(map(running, grandchildren)), "the grandchildren (in the children's groups) to end",
               timeout=5)
    assert group.popens == []
