"""Candidate set-ups: how a GPU total is split into instances, and how each instance schedules.

Spelled as on the command line:

* `2P2D`: P/D with 2 prefill and 2 decode instances;
* `4xsingle`: 4 single instances, the preset's token budget (whole prompts in one step);
* `4xchunked:2048`: 4 single instances with chunked prefill at max-num-batched-tokens 2048.

Each instance is one GPU (tensor parallelism is not modelled).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_CHUNKS = (2048,)


class SetupError(ValueError):
    """A set-up that cannot be built (bad spelling, more instances than GPUs)."""


@dataclass(frozen=True)
class Setup:
    name: str
    mode: str  # "pd" or "single"
    prefills: int = 0
    decodes: int = 0
    singles: int = 0
    chunk: int | None = None  # max-num-batched-tokens with chunked prefill; None = the preset's budget
    recorded: bool = False  # the set-up the workload was recorded on
    on_gpus: int | None = None  # the GPUs its instances time-share, where fewer than them (the recording's)

    @property
    def gpus(self) -> int:
        return self.prefills + self.decodes + self.singles

    def conditions(self) -> dict[str, str]:
        """The report's condition keys for this set-up, so its comparison groups runs as for real ones."""
        out = {"pd.mode": self.mode, "gpu.count": str(self.on_gpus or self.gpus), "pd.run": self.name}
        if self.mode == "pd":
            out.update({"pd.prefill.count": str(self.prefills), "pd.decode.count": str(self.decodes),
                        "pd.kv_connector": "NixlConnector"})
        else:
            out.update({"pd.prefill.count": str(self.singles), "pd.decode.count": str(self.singles)})
        if self.chunk is not None:
            out.update({"vllm.enable_chunked_prefill": "true", "vllm.max_num_batched_tokens": str(self.chunk)})
        return out


_PD = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
_SINGLE = re.compile(r"^(\d+)x(single|chunked)(?::(\d+))?$", re.IGNORECASE)


def parse_setup(spec: str) -> Setup:
    s = spec.strip()
    m = _PD.match(s)
    if m:
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1:
            raise SetupError(f"set-up {spec!r}: P/D needs at least one prefill and one decode instance")
        return Setup(f"{p}P{d}D", "pd", prefills=p, decodes=d)
    m = _SINGLE.match(s)
    if m:
        n, kind, chunk = int(m.group(1)), m.group(2).lower(), m.group(3)
        if n < 1:
            raise SetupError(f"set-up {spec!r}: needs at least one instance")
        if kind == "single":
            if chunk:
                raise SetupError(f"set-up {spec!r}: a chunk size goes with `chunked`, e.g. {n}xchunked:{chunk}")
            return Setup(f"{n}xsingle", "single", singles=n)
        size = int(chunk) if chunk else DEFAULT_CHUNKS[0]
        if size < 1:
            raise SetupError(f"set-up {spec!r}: the chunk size must be >= 1")
        return Setup(f"{n}xchunked:{size}", "single", singles=n, chunk=size)
    raise SetupError(f"set-up {spec!r} not understood: write e.g. 2P2D, 4xsingle or 4xchunked:2048")


def candidates(gpus: int, chunks: tuple[int, ...] = DEFAULT_CHUNKS) -> list[Setup]:
    """Every P:D ratio at `gpus`, all-single, and all-chunked at each chunk size."""
    if gpus < 1:
        raise SetupError("the GPU total must be >= 1")
    out = [Setup(f"{p}P{gpus - p}D", "pd", prefills=p, decodes=gpus - p) for p in range(1, gpus)]
    out.append(Setup(f"{gpus}xsingle", "single", singles=gpus))
    out += [Setup(f"{gpus}xchunked:{c}", "single", singles=gpus, chunk=c) for c in chunks]
    return out


def check_fits(setup: Setup, gpus: int) -> None:
    if setup.gpus > gpus:
        raise SetupError(f"set-up {setup.name} needs {setup.gpus} GPUs (one per instance) but the total is {gpus}")


def recorded(conditions: dict[str, Any]) -> Setup | None:
    """The set-up a recording came from, as its conditions say (None when they do not)."""
    mode = str(conditions.get("pd.mode") or "")
    try:
        if mode == "pd":
            s = parse_setup(f"{int(conditions['pd.prefill.count'])}P{int(conditions['pd.decode.count'])}D")
        elif mode == "single":
            # its instances: the proxy's pool (pd.decode.count) where the record or its traces say, else one per GPU
            n = int(conditions.get("pd.decode.count") or conditions.get("gpu.count"))
            chunk = conditions.get("vllm.max_num_batched_tokens")
            chunked = str(conditions.get("vllm.enable_chunked_prefill", "")).lower() == "true" and chunk
            s = parse_setup(f"{n}xchunked:{int(chunk)}" if chunked else f"{n}xsingle")
        else:
            return None
    except (KeyError, TypeError, ValueError):
        return None
    return replace(s, recorded=True)
