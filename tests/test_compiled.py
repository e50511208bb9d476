"""The compiled hot path (issue 32): which form runs is said at start-up and in /status, a stale
in-place build is reported, and the build falls back to pure Python only when asked to (`auto`).

CI builds the compiled form and sets PDPROXY_EXPECT_COMPILED=1: the proxy must then run every
module of `pdproxy.compiled.MODULES` compiled, so a build that silently fell back fails here."""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import httpx
import pytest

from pdproxy import compiled
from tests.procs import start_proxy, start_scripted

BUILD = Path(__file__).resolve().parent.parent / "_build" / "pdproxy_build.py"


def _build_module():
    spec = importlib.util.spec_from_file_location("pdproxy_build_under_test", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_status_and_start_up_log_say_which_form_runs():
    decode, d_url = start_scripted("decode")
    proxy = None
    try:
        proxy, url = start_proxy("--decode", d_url, "--health-check-interval", "0", "--no-tracing")
        report = httpx.get(url + "/status").json()["compiled"]
        assert set(report["modules"]) == set(compiled.MODULES)
        assert set(report["modules"].values()) <= {"compiled", "python", "stale"}
        assert "hot path" in proxy.output()
        if os.environ.get("PDPROXY_EXPECT_COMPILED") == "1":
            assert report["form"] == "compiled", report
            assert "hot path compiled (mypyc)" in proxy.output()
        else:
            assert report["form"] in ("compiled", "python"), report
    finally:
        if proxy is not None:
            proxy.stop()
        decode.stop()


def test_an_extension_older_than_its_source_is_reported_stale(tmp_path):
    source = tmp_path / "scan.py"
    extension = tmp_path / f"scan{EXTENSION_SUFFIXES[0]}"
    source.write_text("")
    extension.write_bytes(b"")
    os.utime(source, (1_000, 1_000))
    os.utime(extension, (2_000, 2_000))
    assert compiled.form_of_file(str(extension)) == "compiled"
    os.utime(source, (3_000, 3_000))  # edited after the build: the old compiled code is what runs
    assert compiled.form_of_file(str(extension)) == "stale"
    assert compiled.form_of_file(str(source)) == "python"
    # a rebuild rewrites the group library that holds the code, not a shim whose C did not change
    library = tmp_path / f"pdproxy__mypyc{EXTENSION_SUFFIXES[0]}"
    library.write_bytes(b"")
    os.utime(library, (4_000, 4_000))
    assert compiled.form_of_file(str(extension), str(library)) == "compiled"


def test_compile_modes_and_the_fallback(monkeypatch, capsys):
    build = _build_module()
    for value, mode in (("", "0"), ("0", "0"), ("1", "1"), ("auto", "auto")):
        monkeypatch.setenv("PDPROXY_COMPILE", value)
        assert build.compile_mode() == mode
    monkeypatch.setenv("PDPROXY_COMPILE", "fast")
    with pytest.raises(SystemExit, match="expected 0, 1 or auto"):
        build.compile_mode()
    assert build.extensions("0") == []
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert build.extensions("auto") == []  # no compiler: pure Python, said on stderr
    assert "no C compiler" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.extensions("1")  # asked for compiled: fails rather than installing something else
    assert build.modules() == [str(Path(*m.split(".")).with_suffix(".py")) for m in compiled.MODULES]
    assert all((BUILD.parent.parent / m).exists() for m in build.modules())
    assert sys.modules.get("pdproxy_build_under_test") is None
