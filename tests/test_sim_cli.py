"""`pdproxy sim` as an operator meets it: a busy port is one line and exit status 2, and a sim whose
host does not keep up with its simulated timeline says so."""

import os
import signal
import socket
import sys
import threading
import time

import httpx

import procs
from procs import HOST, free_port, start_sim
from waits import wait_until


def test_a_busy_port_is_one_line_and_exit_2():
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        r = procs.run([sys.executable, "-m", "pdproxy", "sim", "--host", HOST, "--port", str(port)], timeout=30)
    finally:
        taken.close()
    assert r.returncode == 2
    assert r.stderr.strip() == f"pdproxy sim: error: cannot listen on {HOST}:{port}: Address already in use"
    assert "Traceback" not in r.stdout + r.stderr


def test_a_sim_that_falls_behind_its_timeline_says_so():
    proc, url = start_sim("single", "--time-scale", "1")
    try:
        body = {"model": "sim-model", "prompt": "a b c", "max_tokens": 600, "ignore_eos": True, "stream": True}
        done = []
        stream = threading.Thread(target=lambda: done.append(httpx.post(url + "/v1/completions", json=body,
                                                                          timeout=60).status_code))
        stream.start()
        wait_until(lambda: httpx.get(url + "/sim/state").json()["steps"] > 5, "the stream to be decoding")
        # the host takes the sim off its cores for 0.6 s mid-stream, as an overloaded machine does
        os.kill(proc.popen.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(proc.popen.pid, signal.SIGCONT)
        state = wait_until(lambda: (s := httpx.get(url + "/sim/state").json())["late_steps"] and s,
                           "a late step to be counted")
        assert state["late_seconds"] >= 0.5
        line = wait_until(lambda: [x for x in proc.output().splitlines() if "falling behind" in x], "the warning",
                          timeout=15)
        assert len(line) == 1 and "WARNING pdproxy.sim" in line[0] and "--time-scale 1" in line[0], line
        stream.join(30)
        assert done == [200]
    finally:
        proc.stop()
