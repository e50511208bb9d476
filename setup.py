"""Optional compiled build of pdproxy's per-request and per-event modules (mypyc).

pyproject.toml holds the project's metadata; this file only adds the C extensions, and only when
PDPROXY_COMPILE asks for them (see `_build/pdproxy_build.py`, which also puts mypy in the build
environment then):
  unset or 0   pure Python (the default: nothing to compile, every edit to a .py file is live)
  1            compile `pdproxy.compiled.MODULES` with mypyc; a failure fails the install
  auto         compile if it can; if any step fails (no compiler, a compiler that fails, mypy refusing a
               module), install pure Python: the build's record says why, and start-up warns
The Python sources stay the source of truth: mypyc compiles them as they are, and a pure-Python
install of the same tree behaves the same (the tests run on both forms).
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build"))
from pdproxy_build import commands, compile_mode, extensions  # noqa: E402  (in-tree build helper)

setup(ext_modules=extensions(compile_mode()), cmdclass=commands())
