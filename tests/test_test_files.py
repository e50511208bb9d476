"""A test's process logs live in its own directory and go with it (issue 41: one CI run left 272 logs in /tmp):
kept only when the test fails, and then named in its report. Checked on a real pytest session with this
suite's conftest.py, in a temporary directory of its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from procs import run

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

INNER = '''
import sys

import pytest

from procs import FILES, Proc


@pytest.fixture(scope="module")
def wider():
    """A process a module fixture starts, still running while the later test fails."""
    proc = Proc([sys.executable, "-c", "print('log-of-a-wider-fixture', flush=True); import time; time.sleep(60)"],
                name="wider")
    yield proc
    proc.stop()


def echo(text):
    proc = Proc([sys.executable, "-c", f"print({text!r})"], name="echo")
    proc.popen.wait()
    proc.stop()
    (FILES.scratch("tool") / "config.yaml").write_text(text)


def test_passes(wider):
    echo("log-of-a-passing-test")


def test_fails(wider):
    echo("log-of-a-failing-test")
    assert False
'''


def _session(tmp_path: Path, *args: str):
    """pytest on INNER with this suite's conftest.py and settings, its temporary directory under tmp_path."""
    inner = tmp_path / "inner"
    inner.mkdir(exist_ok=True)
    (inner / "test_inner.py").write_text(INNER)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(TESTS)}
    return run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                "-c", str(REPO / "pyproject.toml"), "--rootdir", str(inner), str(inner / "test_inner.py"), *args],
               timeout=120, env=env, cwd=inner)


def _files(root: Path) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()}


def test_logs_go_with_a_passing_test_and_stay_named_with_a_failing_one(tmp_path):
    (tmp_path / "tmp").mkdir()
    r = _session(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr  # test_fails failed, test_passes passed
    files = _files(tmp_path / "tmp")
    assert not [p for p, text in files.items() if "log-of-a-passing-test" in text], files
    (failing_log,) = [p for p, text in files.items() if "log-of-a-failing-test" in text and p.suffix == ".log"]
    (wider_log,) = [p for p, text in files.items() if "log-of-a-wider-fixture" in text]
    assert str(failing_log) in r.stdout and str(wider_log) in r.stdout, r.stdout  # named in the failure
    assert "test_inner-test_fails" in str(failing_log)  # in the failing test's own directory
    # the failing test's tool directory stayed beside its log; the passing test's went
    configs = {p: text for p, text in files.items() if p.name == "config.yaml"}
    assert list(configs.values()) == ["log-of-a-failing-test"], configs
    assert next(iter(configs)).parent.parent == failing_log.parent

    before = set(_files(tmp_path / "tmp"))
    r = _session(tmp_path, "-k", "passes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(_files(tmp_path / "tmp")) == before  # a session that passed leaves no file behind
