"""Everything one simulated instance needs to know, resolved from a preset plus overrides."""

from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdproxy.sim.faults import FaultRates
from pdproxy.sim.presets import DEFAULT_PRESET, PRESETS, Preset
from pdproxy.sim.timing import CostModel, PiecewiseLinear

ROLES = ("prefill", "decode", "single")


@dataclass
class SimSettings:
    role: str = "single"
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # what goes into remote_host; defaults to host
    model: str = "sim-model"
    preset: Preset = PRESETS[DEFAULT_PRESET]
    time_scale: float = 1.0
    engine_id: str = ""
    tp_size: int = 1
    kv_lease_seconds: float = 30.0
    skip_kv_pull: bool = False
    enable_prefix_caching: bool = True  # vLLM's default (pdproxy/sim/prefix_cache.py)
    enable_per_request_metrics: bool = False
    enable_request_id_headers: bool = False
    stream_interval: int = 1
    eos_after_tokens: int = 0
    vocab_size: int = 128256
    tokens_per_word: float = 2.3  # the tokenizer's mean (pdproxy/sim/tokens.py)
    seed: int | None = None
    refuse_connections: bool = False
    journal_size: int = 1000
    otlp_traces_endpoint: str | None = None  # vLLM's flag: export llm_request spans there
    otlp_traces_file: str | None = None  # or append them to this OTLP-JSON lines file
    faults: FaultRates = field(default_factory=FaultRates)
    gpu_share_file: str | None = None  # instances naming the same file time-share one GPU (preset gpu_share)
    kv_events: dict[str, Any] | None = None  # from vLLM's --kv-events-config (pdproxy/sim/kv_events.py); None: off

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not self.engine_id:
            self.engine_id = f"sim-{self.role}-{uuid.uuid4().hex[:12]}"
        if self.time_scale <= 0:
            raise ValueError("time scale must be > 0")
        if not 1.0 <= self.tokens_per_word <= 3.0:
            raise ValueError(f"tokens per word must be between 1 and 3, got {self.tokens_per_word:g}")
        if self.stream_interval < 1:
            raise ValueError("stream interval must be >= 1")
        p = self.preset
        if p.num_gpu_blocks and math.ceil(p.max_model_len / p.block_size) > p.num_gpu_blocks:
            raise ValueError(
                f"max model len {p.max_model_len} needs {math.ceil(p.max_model_len / p.block_size)} KV blocks of "
                f"{p.block_size} tokens but the cache has {p.num_gpu_blocks}; lower --max-model-len or raise "
                "--num-gpu-blocks (vLLM refuses to start in this case too)")
        if p.gpu_share < 0:
            raise ValueError("--gpu-share must be >= 0")
        if p.max_num_batched_tokens < 1 or p.max_num_seqs < 1 or p.block_size < 1:
            raise ValueError("max-num-batched-tokens, max-num-seqs and block-size must be >= 1")

    @property
    def has_connector(self) -> bool:
        """Prefill and decode instances run a KV connector (NIXL is symmetric); single has none."""
        return self.role != "single"

    @property
    def instant(self) -> bool:
        return self.preset.instant

    @property
    def kv_remote_host(self) -> str:
        """Where decodes should pull from: --advertise-host, else the listen address, else (wildcard)
        this host's own address as its name resolves (the container/pod IP under Docker or k8s)."""
        host = self.advertise_host or self.host
        if host not in ("0.0.0.0", "", "::"):
            return host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def cost_model(self) -> CostModel:
        p = self.preset
        return CostModel(PiecewiseLinear(p.decode_step_ms), PiecewiseLinear(p.prefill_extra_ms),
                         time_scale=self.time_scale, instant=p.instant)

    def scaled(self, ms: float) -> float:
        """A preset duration in ms -> seconds on this instance's (possibly sped-up) clock."""
        return 0.0 if self.instant else ms * self.time_scale / 1000.0

    def describe(self) -> dict[str, Any]:
        p = self.preset
        preset = {f.name: getattr(p, f.name) for f in fields(p) if f.name not in ("notes",)}
        return {"role": self.role, "model": self.model, "engine_id": self.engine_id, "time_scale": self.time_scale,
                "kv_lease_seconds": self.kv_lease_seconds, "tokens_per_word": self.tokens_per_word,
                "stream_interval": self.stream_interval,
                "preset": preset}


def preset_with(name: str, **overrides: Any) -> Preset:
    """A preset with some fields replaced; `None` values mean "keep the preset's"."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **given)
