"""Malformed records and flags (issue 56): exit 2 and one line naming the file, the line and the field, never a
traceback; `--json` into a directory that does not exist yet creates it. The command's own entry point in this
process (`pdproxy.cli.main`: what `python -m pdproxy` runs) for the cases, one real process for the exit code."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
V = ROOT / "tests" / "fixtures" / "vllm023"
SINGLE = V / "bench-1gpu-single.jsonl.gz"  # 135 requests, one instance: cheap to replay


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdproxy", *args], capture_output=True, text=True, timeout=100,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "80"})


def main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """`pdproxy ARGS` in this process: its exit code, standard output and error, as `cli` gives them."""
    from pdproxy.cli import main as pdproxy_main

    try:
        code = pdproxy_main(list(args))
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def broken(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """The single record with one line changed by `change(lines)`; returns the file (line numbers from 1)."""
    with gzip.open(SINGLE, "rt") as f:
        lines = [json.loads(x) for x in f]
    change(lines)
    out = tmp_path / "broken.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def _request(lines: list, n: int = 5) -> dict:
    return [x for x in lines if x.get("type") == "request"][n]


CASES = {
    "a request without request_id": (lambda ls: _request(ls).pop("request_id"), "field request_id is missing"),
    "workload as a string": (lambda ls: ls[0].update(workload="40 s of agents"), "field workload must be an object"),
    "start_offset a list": (lambda ls: _request(ls).update(start_offset=[1, 2]), "field start_offset must be a number"),
    "prompt_tokens a list": (lambda ls: _request(ls).update(prompt_tokens=[200]),
                             "field prompt_tokens must be a whole number"),
    "a negative prompt_tokens": (lambda ls: _request(ls).update(prompt_tokens=-3),
                                 "field prompt_tokens must not be negative"),
    "classes holding a string": (lambda ls: ls[0]["workload"]["classes"].append("long"),
                                 "field workload.classes[2] must be an object"),
    "itl holding a string": (lambda ls: _request(ls).update(itl=[0.01, "x"]), "field itl must be a list"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_record_is_one_line_naming_file_line_and_field(tmp_path, capsys, case):
    change, message = CASES[case]
    path = broken(tmp_path, change)
    cmds = [("whatif", "--records", str(path), "--preset", "h200-llama8b", "--setup", "1xsingle")]
    if case == "a request without request_id":  # one reader (bench/records.py) for both commands
        cmds.append(("report", str(path)))
    for cmd in cmds:
        r = cli(*cmd) if case == "a request without request_id" else main(capsys, *cmd)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        err = r.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert f"{path}:" in err and message in err, err
        where = int(err.split(f"{path}:")[1].split(":")[0])
        assert where == (1 if "workload" in message else 7), err  # the header, or the 6th request's line


@pytest.mark.parametrize("flag, value", [("--gpus", "0"), ("--jobs", "0"), ("--chunk", "0"), ("--recorded-gpus", "-1"),
                                         ("--slo-ttft-ms", "-5"), ("--max-error-rate", "2")])
def test_a_bad_flag_is_one_line(capsys, flag, value):
    r = main(capsys, "whatif", "--records", str(SINGLE), "--preset", "h200-llama8b", flag, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr, r.stderr


def test_json_into_a_missing_directory_is_created(tmp_path, capsys):
    for cmd in (("whatif", "--records", str(SINGLE), "--preset", "h200-llama8b", "--setup", "1xsingle",
                 "--no-fit-run", "--jobs", "1", "--no-table"), ("report", str(SINGLE), "--no-table")):
        out = tmp_path / cmd[0] / "nested" / "r.json"
        r = main(capsys, *cmd, "--json", str(out))
        assert r.returncode == 0, r.stderr
        assert json.loads(out.read_text())["runs"], cmd
