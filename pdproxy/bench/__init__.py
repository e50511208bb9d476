"""Load generation, per-request records and the comparison report.

The bench only talks to what it measures through public interfaces: HTTP (OpenAI-compatible
routes), the proxy's command line and the OTLP-JSON trace file format. It never imports the
proxy, so it measures pdproxy, a vLLM instance or vllm-router the same way.
"""
