"""pdproxy's build backend: setuptools', plus mypyc when PDPROXY_COMPILE asks for compiled modules.

Why a backend and not only setup.py: mypy (which carries mypyc) must be in pip's isolated build
environment when, and only when, a compiled build is asked for; `get_requires_for_build_*` is the
place a backend says so. Everything else is setuptools.build_meta unchanged.

Every build also writes its record into the package (`pdproxy/compiled.py`'s BUILD_RECORD): the form
asked for, why a compile fell back to pure Python, and the sha256 of each source it compiled. An
installed package reads it to tell a compiled module from a stale one (a wheel keeps no file
times) and to say at start-up that an `auto` build could not compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the backend's other hooks, unchanged)
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.command.build_py import build_py as _build_py

MYPY = "mypy>=1.11"
ROOT = Path(__file__).resolve().parent.parent


def compile_mode() -> str:
    """"0" (pure Python), "1" (compile or fail) or "auto" (compile if possible), from PDPROXY_COMPILE."""
    mode = os.environ.get("PDPROXY_COMPILE", "0").strip().lower()
    if mode in ("", "0", "no", "false", "off"):
        return "0"
    if mode in ("1", "yes", "true", "on"):
        return "1"
    if mode == "auto":
        return "auto"
    raise SystemExit(f"PDPROXY_COMPILE={mode!r}: expected 0, 1 or auto")


def _literal(name: str, closing: str) -> object:
    """A literal assigned at the top of pdproxy/compiled.py (read as text, so that the build does not
    import the package and its dependencies)."""
    namespace: dict[str, object] = {}
    source = (ROOT / "pdproxy" / "compiled.py").read_text()
    start = source.index(f"{name} = ")
    exec(source[start:source.index(closing + "\n", start) + len(closing) + 1], namespace)
    return namespace[name]


def modules() -> list[str]:
    """The compiled modules' source paths, from pdproxy/compiled.py's MODULES."""
    names: tuple[str, ...] = _literal("MODULES", ")")  # type: ignore[assignment]
    return [str(Path(*name.split(".")).with_suffix(".py")) for name in names]


# What this build did, for its record: set by extensions() and by the build_ext step
_OUTCOME: dict[str, object] = {"mode": "0", "error": None, "sources": {}}


def extensions(mode: str) -> list:
    if mode == "0" or _ASKING_REQUIRES:
        _OUTCOME.update(mode=mode, error=None, sources={})
        return []
    started = time.monotonic()
    try:
        missing = _missing_toolchain()
        if missing:
            raise RuntimeError(missing)
        from mypyc.build import mypycify

        sources = {path: _sha256(ROOT / path) for path in modules()}
        exts = mypycify(["--ignore-missing-imports", "--follow-imports=silent", *sources],
                        opt_level=os.environ.get("MYPYC_OPT_LEVEL", "3"), group_name="pdproxy")
    except BaseException as exc:  # mypy absent, or a type error mypyc refuses: SystemExit included
        if mode == "1":
            raise
        _fall_back(exc)
        return []
    _OUTCOME.update(mode=mode, error=None, sources=sources)
    print(f"pdproxy: mypyc generated C for {len(sources)} modules in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return exts


def _fall_back(exc: BaseException) -> None:
    """`auto` and a step of the compile failed: the build goes on in pure Python, and its record says why."""
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    _OUTCOME.update(mode="auto", error=reason, sources={})
    print(f"pdproxy: WARNING: not compiled ({reason}); installing pure Python (PDPROXY_COMPILE=auto)",
          file=sys.stderr)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_record(package_dir: Path) -> None:
    """The build's record, where the installed package finds it (compiled.py's BUILD_RECORD)."""
    package_dir.mkdir(parents=True, exist_ok=True)
    sources = {path.replace(os.sep, "/"): digest for path, digest in _OUTCOME["sources"].items()}  # type: ignore[union-attr]
    record = {"mode": _OUTCOME["mode"], "error": _OUTCOME["error"], "sources": sources}
    (package_dir / _literal("BUILD_RECORD", '"')).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _remove_extensions(top: Path, keep: frozenset[Path] = frozenset()) -> None:
    """Extensions under `top` (the package's and mypyc's group library beside it) that this build did not make."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in [*(top / "pdproxy").rglob(f"*{suffix}"), *top.glob(f"pdproxy__mypyc*{suffix}")]:
        if path.resolve() not in keep:
            path.unlink()


class BuildPy(_build_py):
    """setuptools' step, plus the record of a build that compiles nothing (build_ext does not run then). A
    wheel is packed from everything under build/lib, which an earlier build in the same tree may have
    filled: that build's extensions go, or a pure wheel would carry them."""

    def run(self) -> None:
        super().run()
        if self.distribution.has_ext_modules():
            return  # build_ext writes the record
        if self.editable_mode:
            write_record(ROOT / "pdproxy")
        else:
            _remove_extensions(Path(self.build_lib))
            write_record(Path(self.build_lib) / "pdproxy")


class BuildExt(_build_ext):
    """setuptools' step, where the C compiler runs: under `auto`, any failure of it leaves a pure build."""

    def run(self) -> None:
        build_lib = Path(self.build_lib)
        record_dir = (ROOT if self.editable_mode or self.inplace else build_lib) / "pdproxy"
        made = frozenset(Path(self.get_ext_fullpath(ext.name)).resolve() for ext in self.extensions)
        _remove_extensions(build_lib, keep=made)  # a module dropped from MODULES since the last build
        try:
            super().run()
        except (Exception, SystemExit) as exc:
            if _OUTCOME["mode"] != "auto":
                raise
            _fall_back(exc)
            _remove_extensions(build_lib)  # a failed link may have left some: a shim without its library
            self.extensions = []
        write_record(record_dir)


def commands() -> dict[str, type]:
    """setup.py's cmdclass."""
    return {"build_py": BuildPy, "build_ext": BuildExt}


def remove_inplace_extensions() -> None:
    """An editable install builds the extensions beside the sources, where Python prefers them to the
    .py files: an editable rebuild (pure, or with other modules) first removes the previous build's.
    Other builds (`pip wheel .`, `pip install .`) leave them alone."""
    _remove_extensions(ROOT)
    (ROOT / "pdproxy" / _literal("BUILD_RECORD", '"')).unlink(missing_ok=True)  # type: ignore[arg-type]


def _missing_toolchain() -> str | None:
    """What a C build needs and this machine lacks (a compiler, Python's headers), if anything."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        return f"no C compiler ({compiler})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h; Debian: python3-dev)"
    return None


# setuptools runs setup.py to learn its requirements (before mypy is installed) and its metadata:
# no extensions then
_ASKING_REQUIRES = False


def _metadata_only(step):
    global _ASKING_REQUIRES
    _ASKING_REQUIRES = True
    try:
        return step()
    finally:
        _ASKING_REQUIRES = False


def _requires(ask) -> list[str]:
    return _metadata_only(ask) + ([MYPY] if compile_mode() != "0" else [])


def get_requires_for_build_wheel(config_settings=None):
    return _requires(lambda: _setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _requires(lambda: _setuptools.get_requires_for_build_editable(config_settings))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    remove_inplace_extensions()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


# the metadata step runs setup.py too, and needs no C: one mypyc run per install instead of two
def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _metadata_only(lambda: _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _metadata_only(
        lambda: _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings))
