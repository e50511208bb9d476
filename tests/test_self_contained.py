"""Nothing under tests/ or benchmarks/ names a path outside the repository.

A clone must pass its own suite with nothing beside it (issue 18: the recorded traces were read from
a research folder beside the clone, which only the project's CI layout had). Data a test needs is a fixture in the repo.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from real_traces import REAL_TRACES

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks")
TEXT = {".py", ".md", ".yaml", ".yml", ".json", ".toml", ".sh", ".txt", ".cfg", ".ini"}

# Text that can only mean a place outside the clone, wherever the clone is.
OUTSIDE = [
    (re.compile(r"(?<![\w.~-])/(?:work|home|root|mnt|srv|Users)/"), "an absolute path on some machine"),
    (re.compile(r"\.\./+(?:\.\./+)*shared\b"), "a folder beside the clone, by a relative path"),
    (re.compile(r"""\.parent\s*/\s*["']shared["']"""), "a 'shared' folder beside the clone"),
    (re.compile(r"""["']shared/research\b|\bresearch/real-traces\b"""), "the research folder beside the clone"),
    (re.compile(r"\b(?:REPO|REPO_ROOT|PROJECT)\s*\.\s*parents?\b"), "the parent of the repository"),
    (re.compile(r"(?:os\.path\.)?expanduser\(|Path\.home\("), "the user's home folder"),
]
# Path(__file__) climbed more levels than the file is deep: above the repository.
CLIMB = re.compile(r"Path\(__file__\)(?:\.resolve\(\)|\.absolute\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])")


def scanned_files() -> list[Path]:
    files = [p for top in SCANNED for p in sorted((REPO / top).rglob("*"))
             if p.is_file() and p.suffix in TEXT and "__pycache__" not in p.parts]
    # the provenance notes of the recording, and this file (its patterns and probes name the ways out)
    return [p for p in files if not p.is_relative_to(REAL_TRACES) and p != Path(__file__).resolve()]


def outside_references(text: str, depth: int) -> list[str]:
    """Every reference to a place outside the repository in a file `depth` folders below the root."""
    found = []
    for no, line in enumerate(text.splitlines(), 1):
        for pattern, why in OUTSIDE:
            if pattern.search(line):
                found.append(f"{no}: {why}: {line.strip()}")
        for m in CLIMB.finditer(line):
            # parents[k] is k+1 levels up; each .parent one level; the file's folder is already one
            up = int(m.group(2)) + 1 if m.group(2) is not None else m.group(1).count(".parent")
            if up > depth + 1:
                found.append(f"{no}: {up} levels above a file {depth} deep: {line.strip()}")
    return found


def test_no_file_under_tests_or_benchmarks_names_a_path_outside_the_repository():
    files = scanned_files()
    assert len(files) > 50, f"the scan found only {len(files)} files: wrong root {REPO}?"
    bad = {}
    for p in files:
        rel = p.relative_to(REPO)
        if refs := outside_references(p.read_text(errors="replace"), len(rel.parts) - 1):
            bad[str(rel)] = refs
    assert not bad, "paths outside the repository:\n" + "\n".join(
        f"  {f}:{r}" for f, refs in bad.items() for r in refs)


FOLDER = "sha" + "red"  # spelt apart: a plain grep for the folder beside the clone must not flag this file


@pytest.mark.parametrize("line", [
    f'CANDIDATES = [REPO.parent / "{FOLDER}", REPO.parent.parent / "{FOLDER}"]',
    'd = Path(__file__).resolve().parents[2] / "research"',
    'd = Path(__file__).parent.parent.parent / "x"',
    f'TRACES = "../{FOLDER}/research/real-traces"',
    f'open("/work/{FOLDER}/research/real-vllm-h200.md")',
    'p = os.path.expanduser("~/traces")',
])
def test_the_scan_catches_each_way_out(line: str):
    """Each way the suite once left the clone (or could) is reported in a file of tests/."""
    assert outside_references(line, depth=1), line


@pytest.mark.parametrize("line", [
    'REPO = Path(__file__).resolve().parents[1]',
    'ROOT = Path(__file__).resolve().parent.parent',
    'HERE = Path(__file__).parent / "fixtures" / "vllm023"',
    'assert "../collector/otelcol.yaml:/etc/otelcol-contrib/config.yaml:ro" in col["volumes"]',
    'log = Path("/tmp") / "x.log"',
])
def test_the_scan_leaves_paths_inside_the_repository_alone(line: str):
    assert not outside_references(line, depth=1), line


def test_the_recorded_traces_are_in_the_repository():
    names = {p.name for p in REAL_TRACES.iterdir()}
    assert {"vllm023-pd-1gpu.otlp.jsonl.gz", "vllm023-pd-2gpu.otlp.jsonl.gz", "bench-1gpu-pd.jsonl.gz",
            "bench-1gpu-single.jsonl.gz", "bench-2gpu-pd.jsonl.gz", "bench-2gpu-single.jsonl.gz",
            "README.md"} <= names
    assert REAL_TRACES.is_relative_to(REPO)
