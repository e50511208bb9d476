#!/usr/bin/env bash
# Build pdproxy's OpenTelemetry Collector distribution from collector/builder-config.yaml with the
# OpenTelemetry Collector Builder (ocb), into the ignored folder .tools/otelcol-pdproxy/.
#
#   collector/build.sh            # prints the binary's path on stdout (progress goes to stderr)
#   FORCE=1 collector/build.sh    # rebuild even when the binary is newer than the manifest
#
# Idempotent and cheap when nothing changed: the build is skipped while the binary is newer than
# the manifest and this script. Uses the machine's Go module and build caches (GOMODCACHE,
# GOCACHE), so a rebuild after a manifest change only compiles what changed. Concurrent callers
# (CI's background build and a test that needs the binary) wait for one another.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MANIFEST="$REPO/collector/builder-config.yaml"
OUT="$REPO/.tools/otelcol-pdproxy"
BIN="$OUT/otelcol-pdproxy"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"  # the generated module sits inside this git work tree

fresh() { [ -x "$BIN" ] && [ "$BIN" -nt "$MANIFEST" ] && [ "$BIN" -nt "${BASH_SOURCE[0]}" ]; }

if [ -z "${FORCE:-}" ] && fresh; then echo "$BIN"; exit 0; fi

command -v go >/dev/null || { echo "collector/build.sh: go is not installed" >&2; exit 1; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9  # one build at a time; the others find the fresh binary afterwards
if [ -z "${FORCE:-}" ] && fresh; then echo "$BIN"; exit 0; fi

# The builder's own release is the collector release the manifest pins (its telemetry module).
VERSION="$(sed -n 's|^ *gomod: go.opentelemetry.io/collector/service \(v[0-9.]*\).*|\1|p' "$MANIFEST")"
[ -n "$VERSION" ] || { echo "collector/build.sh: no collector release found in $MANIFEST" >&2; exit 1; }
OCB="$REPO/.tools/ocb/$VERSION/builder"
if [ ! -x "$OCB" ]; then
  echo "installing the OpenTelemetry Collector Builder $VERSION" >&2
  GOBIN="$(dirname "$OCB")" go install "go.opentelemetry.io/collector/cmd/builder@$VERSION" >&2
fi

# Generated sources (main.go, components.go, go.mod, go.sum) go to a scratch folder next to the
# binary; output_path is the only difference from the committed manifest.
SRC="$OUT/src"
rm -rf "$SRC"
mkdir -p "$SRC"
sed "s|^dist:|dist:\n  output_path: $SRC|" "$MANIFEST" > "$OUT/manifest.yaml"
started=$SECONDS
echo "building otelcol-pdproxy (collector $VERSION); the first build downloads and compiles a few hundred modules" >&2
"$OCB" --config "$OUT/manifest.yaml" >&2
mv -f "$SRC/otelcol-pdproxy" "$BIN"
echo "built $BIN in $((SECONDS - started)) s" >&2
echo "$BIN"
