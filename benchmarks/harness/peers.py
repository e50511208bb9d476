"""The two proxies pdproxy is measured against, obtained at benchmark time and never committed.

* vllm-router (Rust, PyPI `vllm-router`), in P/D mode: installed with pip when missing.
* vLLM's toy proxy (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, FastAPI + httpx):
  taken from vLLM's source distribution. `pip download --no-binary :all:` of the sdist stops at
  its metadata step (vLLM's build needs CUDA tooling) but leaves the unpacked tree behind, which
  is all we need. The file is copied into the benchmark's work directory (outside the repository).
  Its dependencies are installed as a vLLM environment has them: fastapi, `uvicorn[standard]`
  (uvloop + httptools, which vLLM's `fastapi[standard]` pulls in) and httpx.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.33.0"
VLLM_ROUTER_VERSION = "0.1.17"
TOY_PATH = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def vllm_router() -> str:
    """Path of the `vllm-router` launcher, installing the PyPI package when it is missing."""
    exe = shutil.which("vllm-router")
    if exe is None:
        print(f"installing vllm-router=={VLLM_ROUTER_VERSION} ...", flush=True)
        _pip(f"vllm-router=={VLLM_ROUTER_VERSION}")
        exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    return exe


def toy_proxy(work: Path) -> Path:
    """vLLM's toy proxy script from vLLM's sdist, cached in `work`; its dependencies installed."""
    target = work / f"vllm-{VLLM_VERSION}-toy_proxy_server.py"
    if not target.exists():
        scratch = work / "sdist"
        scratch.mkdir(parents=True, exist_ok=True)
        print(f"fetching vLLM {VLLM_VERSION} source distribution for its toy proxy ...", flush=True)
        env = {**os.environ, "TMPDIR": str(scratch)}
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-clean",
                        "--disable-pip-version-check", "-q", f"vllm=={VLLM_VERSION}", "-d", str(scratch / "out")],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fails after unpacking
        found = glob.glob(str(scratch / "**" / TOY_PATH), recursive=True)
        if not found:
            raise RuntimeError(f"vLLM {VLLM_VERSION} sdist did not unpack {TOY_PATH} under {scratch}")
        shutil.copy(found[0], target)
        shutil.rmtree(scratch, ignore_errors=True)
    missing = [m for m in ("fastapi", "uvicorn", "httpx", "httptools") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"installing the toy proxy's dependencies ({', '.join(missing)}) ...", flush=True)
        _pip("fastapi", "uvicorn[standard]", "httpx")
    return target
