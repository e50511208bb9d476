"""`pdproxy serve`: read the settings, then start the server.

The settings module (pdproxy/config.py) is a leaf that everything below reads; this module is
the one place above both that joins them, so nothing imports its way back up into the CLI.
"""

from __future__ import annotations

import argparse
import sys

from pdproxy.config import ConfigError, add_arguments, load_settings

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args)
    except ConfigError as exc:
        print(f"pdproxy serve: error: {exc}", file=sys.stderr)
        return 2
    from pdproxy.server import serve  # the server's stack loads only once the settings are good

    return serve(settings)
