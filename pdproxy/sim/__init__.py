"""Simulated vLLM instances for P/D experiments without GPUs (`pdproxy sim`).

An OpenAI-compatible server with vLLM's extras (kv_transfer_params, per-request metrics,
/metrics names) whose timing comes from a continuous-batching engine loop calibrated on real
vLLM measurements (see `presets.py`). It meets the proxy only over HTTP and imports nothing
from it. Token rule, in short: one token per whitespace-separated word (details in `tokens.py`
and docs/reference/sim.md).
"""
