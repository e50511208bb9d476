"""pdproxy's build backend: setuptools', plus mypyc when PDPROXY_COMPILE asks for compiled modules.

Why a backend and not only setup.py: mypy (which carries mypyc) must be in pip's isolated build
environment when, and only when, a compiled build is asked for; `get_requires_for_build_*` is the
place a backend says so. Everything else is setuptools.build_meta unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the backend's other hooks, unchanged)

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


def modules() -> list[str]:
    """The compiled modules' source paths, from pdproxy/compiled.py's MODULES (one list, read as text
    so that the build does not import the package and its dependencies)."""
    namespace: dict[str, object] = {}
    source = (ROOT / "pdproxy" / "compiled.py").read_text()
    start = source.index("MODULES = (")
    exec(source[start:source.index(")\n", start) + 2], namespace)  # a literal tuple of names
    names: tuple[str, ...] = namespace["MODULES"]  # type: ignore[assignment]
    return [str(Path(*name.split(".")).with_suffix(".py")) for name in names]


def extensions(mode: str) -> list:
    if mode == "0" or _ASKING_REQUIRES:
        return []
    started = time.monotonic()
    try:
        missing = _missing_toolchain()
        if missing:
            raise RuntimeError(missing)
        from mypyc.build import mypycify

        exts = mypycify(["--ignore-missing-imports", "--follow-imports=silent", *modules()],
                        opt_level=os.environ.get("MYPYC_OPT_LEVEL", "3"), group_name="pdproxy")
    except BaseException as exc:  # mypy absent, or a type error mypyc refuses: SystemExit included
        if mode == "1":
            raise
        print(f"pdproxy: not compiled ({type(exc).__name__}: {exc}); installing pure Python", file=sys.stderr)
        return []
    print(f"pdproxy: mypyc generated C for {len(modules())} modules in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return exts


def remove_inplace_extensions() -> None:
    """An editable install builds the extensions beside the sources, where Python prefers them to the
    .py files: an editable rebuild (pure, or with other modules) first removes the previous build's.
    Other builds (`pip wheel .`, `pip install .`) leave them alone."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in [*(ROOT / "pdproxy").rglob(f"*{suffix}"), *ROOT.glob(f"pdproxy__mypyc*{suffix}")]:
        path.unlink()


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
