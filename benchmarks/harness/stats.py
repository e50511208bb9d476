"""CPU time and memory of a process tree, and the load of the whole machine, read from /proc (Linux)."""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """The process and all its descendants (workers; threads are inside)."""
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of `pids` so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def memory_kb(pids: list[int], key: str) -> int:
    """A /proc/PID/status field (VmRSS: now, VmHWM: peak) summed over `pids`, in kB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def rss_bytes(pid: int) -> int:
    """One process's resident memory now."""
    return memory_kb([pid], "VmRSS") * 1024


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, to report load from processes that are not ours."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def wait_quiet(timeout: float, threshold: float = 0.25) -> float:
    """Wait (up to `timeout` s) until the rest of the machine uses under `threshold` cores for a second;
    between phases our own processes are idle, so what is busy then is someone else's. Returns the load."""
    deadline = time.monotonic() + timeout
    while True:
        (b0, _), start = machine_busy(), time.monotonic()
        time.sleep(1.0)
        (b1, _), elapsed = machine_busy(), time.monotonic() - start
        busy = (b1 - b0) / CLK_TCK / elapsed
        if busy < threshold or time.monotonic() > deadline:
            return busy


def machine() -> str:
    """CPUs, memory, kernel, Python and host name, for a report's first line."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    return (f"{os.cpu_count()} x {model}, {mem:.0f} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}, {socket.gethostname()}")
