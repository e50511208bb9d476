"""pdproxy: a drop-in, OpenTelemetry-instrumented proxy for vLLM prefill/decode disaggregation."""

__version__ = "0.1.0"
