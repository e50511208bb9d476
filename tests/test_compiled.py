"""The compiled hot path (issues 32 and 41): which form runs is said at start-up and in /status; a module is
stale when its source is not the one the build recorded (by content: an installed wheel keeps no file
times); `auto` falls back to pure Python on any failure of the compile, and start-up says so.

CI builds the manylinux wheel, installs it into a fresh environment and runs the suite against it with
PDPROXY_EXPECT_COMPILED=1 and PDPROXY_EXPECT_INSTALLED=1: the proxy must then run every module of
`pdproxy.compiled.MODULES` compiled, from the installed package, so a build that silently fell back or a
source tree that shadows the installed package fails here."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import httpx
import pytest

import pdproxy
from pdproxy import compiled
from procs import run, start_proxy, start_scripted

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "_build" / "pdproxy_build.py"
EXPECT_INSTALLED = os.environ.get("PDPROXY_EXPECT_INSTALLED") == "1"


def _build_module():
    spec = importlib.util.spec_from_file_location("pdproxy_build_under_test", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _served(env: dict[str, str]) -> tuple[dict, str]:
    """`pdproxy serve` run from the environment `env`: its /status's compiled report, and its start-up log."""
    decode, d_url = start_scripted("decode")
    proxy = None
    try:
        proxy, url = start_proxy("--decode", d_url, "--health-check-interval", "0", "--no-tracing", env=env)
        return httpx.get(url + "/status").json()["compiled"], proxy.output()
    finally:
        if proxy is not None:
            proxy.stop()
        decode.stop()


def test_status_and_start_up_log_say_which_form_runs():
    report, log = _served({})
    assert set(report["modules"]) == set(compiled.MODULES)
    assert set(report["modules"].values()) <= {"compiled", "python", "stale"}
    assert "hot path" in log
    if os.environ.get("PDPROXY_EXPECT_COMPILED") == "1":
        assert report["form"] == "compiled", report
        assert report["build"] == {"mode": "1", "error": None}, report
        assert "hot path compiled (mypyc)" in log
    else:
        assert report["form"] in ("compiled", "python"), report


@pytest.mark.skipif(not EXPECT_INSTALLED, reason="CI's pass on the installed wheel (PDPROXY_EXPECT_INSTALLED=1)")
def test_the_suite_runs_the_installed_package_not_the_source_tree():
    """`python -m pytest` and `python -m pdproxy` put the working directory first on sys.path, where the source
    tree would shadow the installed wheel; CI sets PYTHONSAFEPATH=1 so that what ships is what is tested."""
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    here = Path(pdproxy.__file__).resolve()
    assert here.is_relative_to(purelib) and not here.is_relative_to(REPO / "pdproxy"), here
    child = run([sys.executable, "-m", "pdproxy.compiled"], timeout=60, cwd=REPO)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert Path(report["package"]).resolve() == here.parent, report
    assert report["form"] == "compiled" and set(report["modules"].values()) == {"compiled"}, report


def test_a_module_is_stale_when_its_source_is_not_the_one_the_build_recorded(tmp_path):
    source = tmp_path / "scan.py"
    extension = tmp_path / f"scan{EXTENSION_SUFFIXES[0]}"
    source.write_text("x = 1\n")
    extension.write_bytes(b"")
    recorded = hashlib.sha256(b"x = 1\n").hexdigest()
    os.utime(extension, (1_000, 1_000))  # older than its source, as a wheel's install may leave it
    assert compiled.form_of_file(str(extension), recorded) == "compiled"
    source.write_text("x = 2\n")  # edited after the build: the old compiled code is what runs
    assert compiled.form_of_file(str(extension), recorded) == "stale"
    assert compiled.form_of_file(str(extension), None) == "stale"  # no record: it cannot be vouched for
    assert compiled.form_of_file(str(source), recorded) == "python"
    source.unlink()
    assert compiled.form_of_file(str(extension), None) == "compiled"  # no source beside it to differ from


def test_compile_modes_and_the_fallback(monkeypatch, capsys):
    pytest.importorskip("setuptools", reason="the build backend's own environment (pip's isolated one) has it")
    build = _build_module()
    for value, mode in (("", "0"), ("0", "0"), ("1", "1"), ("auto", "auto")):
        monkeypatch.setenv("PDPROXY_COMPILE", value)
        assert build.compile_mode() == mode
    monkeypatch.setenv("PDPROXY_COMPILE", "fast")
    with pytest.raises(SystemExit, match="expected 0, 1 or auto"):
        build.compile_mode()
    assert build.extensions("0") == []
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert build.extensions("auto") == []  # no compiler: pure Python, said on stderr and in the build's record
    assert "no C compiler" in capsys.readouterr().err
    assert "no C compiler" in build._OUTCOME["error"]
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.extensions("1")  # asked for compiled: fails rather than installing something else
    assert build.modules() == [str(Path(*m.split(".")).with_suffix(".py")) for m in compiled.MODULES]
    assert all((REPO / m).exists() for m in build.modules())
    assert build._literal("BUILD_RECORD", '"') == compiled.BUILD_RECORD
    assert sys.modules.get("pdproxy_build_under_test") is None


# Real builds of the project's backend, each of a copy of the tree whose MODULES is one small module (the
# backend and the installed package's report are under test here). CI runs them in its pass on the source
# tree; its pass on the installed wheel has the whole build under test.
SMALL = "pdproxy.telemetry.clock"
builds = pytest.mark.skipif(EXPECT_INSTALLED, reason="run in CI's pass on the source tree")
COMPILE = {"PDPROXY_COMPILE": "1", "MYPYC_OPT_LEVEL": "0"}  # the C compiler's quickest


def _small_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "src"
    tree.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", compiled.BUILD_RECORD)
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy2(REPO / name, tree / name)
    for name in ("_build", "pdproxy"):
        shutil.copytree(REPO / name, tree / name, ignore=ignore)
    source = (tree / "pdproxy" / "compiled.py").read_text()
    start = source.index("MODULES = (")
    end = source.index(")\n", start) + 2
    (tree / "pdproxy" / "compiled.py").write_text(source[:start] + f"MODULES = ({SMALL!r},)\n" + source[end:])
    return tree


def _pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    r = run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], timeout=600,
            env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def _wheel(tree: Path, out: Path, **env: str) -> tuple[Path, list[str]]:
    """The wheel pip builds of `tree`, and the files in it."""
    _pip("wheel", "--no-deps", "-w", str(out), str(tree), env=env)
    (wheel,) = out.glob("pdproxy-*.whl")
    return wheel, zipfile.ZipFile(wheel).namelist()


def _install(wheel: Path, target: Path) -> dict[str, str]:
    """Installed by pip into a directory of its own; the environment that imports it from there (and not
    from the source tree or the suite's own install)."""
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    return {"PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}


def _report(env: dict[str, str], cwd: Path) -> dict:
    r = run([sys.executable, "-m", "pdproxy.compiled"], timeout=60, env={**os.environ, **env}, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@builds
def test_an_installed_wheel_runs_compiled_and_an_edit_after_the_build_is_stale(tmp_path):
    wheel, names = _wheel(_small_tree(tmp_path), tmp_path / "dist", **COMPILE)
    assert any(n.startswith("pdproxy/telemetry/clock.") and n.endswith(".so") for n in names), names
    env = _install(wheel, tmp_path / "site")
    report, log = _served(env)
    assert report == {"form": "compiled", "modules": {SMALL: "compiled"}, "build": {"mode": "1", "error": None}}
    assert "hot path compiled (mypyc): 1 modules" in log
    assert Path(_report(env, tmp_path)["package"]) == tmp_path / "site" / "pdproxy"
    source = tmp_path / "site" / "pdproxy" / "telemetry" / "clock.py"
    source.write_text(source.read_text() + "# edited after the build\n")
    assert _report(env, tmp_path)["modules"] == {SMALL: "stale"}


@builds
def test_an_editable_build_edited_afterwards_is_stale(tmp_path):
    tree = _small_tree(tmp_path)
    _pip("install", "--no-deps", "--target", str(tmp_path / "site"), "-e", str(tree), env=COMPILE)
    env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}  # the extensions beside the sources, as an editable run
    assert _report(env, tmp_path)["modules"] == {SMALL: "compiled"}
    source = tree / "pdproxy" / "telemetry" / "clock.py"
    source.write_text(source.read_text() + "# edited after the build\n")
    report = _report(env, tmp_path)
    assert report["form"] == "stale" and report["modules"] == {SMALL: "stale"}, report


@builds
def test_auto_falls_back_to_pure_python_when_the_compiler_fails_and_start_up_says_so(tmp_path):
    wheel, names = _wheel(_small_tree(tmp_path), tmp_path / "dist", PDPROXY_COMPILE="auto", CC="false")
    assert not any(n.endswith(".so") for n in names), names
    report, log = _served(_install(wheel, tmp_path / "site"))
    assert report["form"] == "python" and report["build"]["mode"] == "auto", report
    assert "false" in report["build"]["error"], report  # the command that failed
    warning = next(line for line in log.splitlines() if "hot path" in line)
    assert "WARNING" in warning and "could not compile" in warning and "false" in warning, warning
