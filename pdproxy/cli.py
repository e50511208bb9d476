"""The `pdproxy` command.

Subcommand modules expose `add_arguments(parser)` and `run(args) -> int` and are imported
lazily, so `pdproxy sim` does not pay for the proxy's telemetry stack and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """\
pdproxy sits in front of vLLM prefill and decode instances as a drop-in for vLLM's P/D proxy:
each request is prefilled on one instance and decoded on another, and every request becomes a
trace (queue, prefill, KV transfer, decode) and Prometheus metrics (TTFT, ITL, tail ITL). It also
simulates vLLM instances, drives workloads, and reports whether P/D beats a single instance for
your traffic.

Start with `pdproxy demo`: single vs chunked prefill vs P/D on simulated instances, with a verdict."""
EPILOG = "Run `pdproxy COMMAND --help` for a command's flags."

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdproxy.serve_cli", "run the P/D proxy (drop-in for vLLM's XpYd toy proxy)"),
    "sim": ("pdproxy.sim.cli", "run a simulated vLLM instance (prefill, decode or single)"),
    "bench": ("pdproxy.bench.cli", "drive a workload against an OpenAI-compatible endpoint"),
    "report": ("pdproxy.bench.report_cli", "turn bench records and traces into the comparison table"),
    "trace": ("pdproxy.bench.trace_cli", "one request's waterfall: proxy stages and vLLM's spans, from files or a store"),
    "whatif": ("pdproxy.whatif.cli", "predict the report of set-ups not run, from a recorded workload (virtual time)"),
    "demo": ("pdproxy.demo", "single vs chunked vs P/D on simulated instances, end to end"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdproxy", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from pdproxy import __version__

    parser.add_argument("--version", action="version", version=f"pdproxy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
            parser.set_defaults(_subparser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    chosen = vars(args).pop("_subparser", None)
    if unknown:  # said with the subcommand's usage, which lists its flags, not the top level's
        (chosen or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
