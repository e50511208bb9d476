"""The test helpers' waits: a state or a named failure; one scale factor; phases that cannot starve each other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waits import Load, wait_until

HERE = Path(__file__).resolve().parent


def scale_seen(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDPROXY_TEST_TIMEOUT_SCALE"}
    env["PYTHONPATH"] = str(HERE)  # under PYTHONSAFEPATH=1 (CI) the working directory is not on sys.path
    if value is not None:
        env["PDPROXY_TEST_TIMEOUT_SCALE"] = value
    return subprocess.run([sys.executable, "-c", "import waits; print(waits.scaled(10))"], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=60)


def test_one_factor_scales_every_bound():
    assert scale_seen(None).stdout.strip() == "10.0"
    assert scale_seen("3").stdout.strip() == "30.0"
    bad = scale_seen("fast")
    assert bad.returncode != 0 and "PDPROXY_TEST_TIMEOUT_SCALE must be a number" in bad.stderr


def test_wait_until_returns_the_state_or_names_what_it_waited_for():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), "three polls", interval=0) == "ready"

    def refused():
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(AssertionError, match=r"waiting for the port to answer \(last: ConnectionRefusedError"):
        wait_until(refused, "the port to answer", timeout=0.2)

    def exited():
        raise AssertionError("the process exited 1")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="the process exited 1"):  # at once: that state will not come
        wait_until(exited, "the process to answer", timeout=30)
    assert time.monotonic() - started < 5


def test_a_phase_cap_idles_the_sender_and_a_starved_phase_is_named():
    with Load(lambda phase: phase, ["first", "second"], cap=5) as load:
        load.run_phase("first", 0.2, minimum=5)
        time.sleep(0.1)
        assert len(load.results["first"]) == 5  # capped: the sender waits for the next phase
        assert load.run_phase("second", 0.1, minimum=5) == ["second"] * 5
    assert load.made == 10

    def stuck(phase):
        if phase == "late":
            time.sleep(0.5)
        return phase

    with Load(stuck, ["early", "late"]) as load:
        load.run_phase("early", 0.05, minimum=1)
        load.enter("late")
        with pytest.raises(AssertionError, match=r"phase 'late' starved: [01] requests, at least 1000 needed"):
            load._stop.set()  # no more requests: the phase cannot reach its minimum
            load.end_phase("late", minimum=1000)
