#!/usr/bin/env bash
# Start pdproxy's collector distribution on collector/otelcol.yaml, once collector/check.py has
# found no exporter pointing back at the collector's own OTLP receiver (a trace store endpoint such
# as TEMPO_OTLP_ENDPOINT=localhost:4317 would feed every kept trace back in: counted again, forever).
#
#   TEMPO_OTLP_ENDPOINT=127.0.0.1:14317 collector/run.sh          # listeners and more: see otelcol.yaml's head
#   OTELCOL_CONFIG=collector/otelcol-tier1.yaml collector/run.sh   # another configuration
#
# Extra arguments go to the collector (e.g. --set=...). OTELCOL_BIN picks another binary (the
# upstream otelcol-contrib, say); by default collector/build.sh's, built when missing or stale.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${OTELCOL_CONFIG:-$REPO/collector/otelcol.yaml}"
BIN="${OTELCOL_BIN:-$(bash "$REPO/collector/build.sh")}"
"${PYTHON:-python3}" "$REPO/collector/check.py" --binary "$BIN" --config "$CONFIG"
exec "$BIN" --config="$CONFIG" "$@"
