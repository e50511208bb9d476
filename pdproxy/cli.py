"""The `pdproxy` command: one subcommand per job, each owned by its own module.

Subcommand modules expose `add_arguments(parser)` and `run(args) -> int` and are imported
lazily, so `pdproxy sim` does not pay for the proxy's telemetry stack and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdproxy.config", "run the P/D proxy (drop-in for vLLM's XpYd toy proxy)"),
    "sim": ("pdproxy.sim.cli", "run a simulated vLLM instance (prefill, decode or single)"),
    "bench": ("pdproxy.bench.cli", "drive a workload against an OpenAI-compatible endpoint"),
    "report": ("pdproxy.bench.report_cli", "turn bench records and traces into the comparison table"),
    "trace": ("pdproxy.bench.trace_cli", "one request's waterfall: proxy stages and vLLM's spans, from files or a store"),
    "demo": ("pdproxy.demo", "single vs chunked vs P/D on simulated instances, end to end"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdproxy", description=__doc__.splitlines()[0])
    from pdproxy import __version__

    parser.add_argument("--version", action="version", version=f"pdproxy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
