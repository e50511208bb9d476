"""The benchmarks' shared harness (benchmarks/harness/): what every script relies on to leave nothing running
and to charge a proxy for all of its processes' CPU."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from procs import running
from waits import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import harness  # noqa: E402

# A parent that starts a child of its own (as `pdproxy serve --workers 2` or `taskset` + valgrind do), writes
# both pids to a file, then waits; with BURN set the child spends CPU until it is stopped.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
                              "import os\\nwhile os.environ.get('BURN'): pass\\nimport time; time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def started(procs: harness.Procs, tmp_path: Path, burn: bool = False) -> tuple[harness.Proc, list[int]]:
    pids_file = tmp_path / "pids"
    proc = procs.start("parent", [sys.executable, "-c", PARENT, str(pids_file)], env={"BURN": "1" if burn else ""})
    pids = wait_until(lambda: pids_file.exists() and [int(p) for p in pids_file.read_text().split()],
                      "the parent and its child to start")
    return proc, pids


def test_procs_stop_the_whole_group_even_when_the_run_fails(tmp_path):
    with pytest.raises(RuntimeError, match="a failed measurement"):
        with harness.Procs() as procs:
            proc, pids = started(procs, tmp_path)
            assert all(running(pid) for pid in pids)
            raise RuntimeError("a failed measurement")
    assert proc.popen.returncode is not None
    wait_until(lambda: not any(running(pid) for pid in pids), "the parent's own child to be gone too")


def test_cpu_seconds_count_the_children_of_the_process(tmp_path):
    with harness.Procs() as procs:
        proc, (parent, child) = started(procs, tmp_path, burn=True)
        assert proc.pids() == [parent, child]
        wait_until(lambda: proc.cpu_seconds() >= 1.0, "the busy child's CPU to be charged to its parent's tree")
        own = harness.stats.cpu_seconds([parent])
        assert own < 0.5 and harness.stats.cpu_seconds([child]) >= 1.0 - own
        assert proc.memory_mb("VmRSS") > harness.stats.memory_kb([parent], "VmRSS") / 1024
    # the group was signalled and the parent reaped; the busy child ends (and is reaped by init) a moment later
    wait_until(lambda: not running(child), "the busy child to be gone")


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = harness.free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as s:
            s.bind((harness.HOST, port))


def test_python_in_runs_the_pdproxy_of_the_given_tree(tmp_path):
    (tmp_path / "pdproxy").mkdir()
    (tmp_path / "pdproxy" / "__init__.py").write_text("WHERE = 'the other tree'\n")
    out = harness.python_in(str(tmp_path), ["-c", "import pdproxy, os; print(pdproxy.WHERE, os.getcwd())"])
    assert out.stdout.split(" ", 3)[:3] == ["the", "other", "tree"] and out.stdout.strip().endswith(str(tmp_path))
    assert os.getcwd() != str(tmp_path)
