#!/usr/bin/env bash
# Build Prometheus 3 (the release deploy/compose.yaml pins) from its Go module into the ignored
# folder .tools/prometheus3/, for the end-to-end tests (Debian's package is Prometheus 2).
#
#   tools/build-prometheus.sh     # prints the binary's path on stdout (progress goes to stderr)
#
# Prometheus 3.14.0 is the Go module github.com/prometheus/prometheus v0.314.0. Built without the
# web UI's assets (the HTTP API is all the tests use) and without service discovery plugins
# (`remove_all_sd`: static targets only), which also keeps the cold build short. Idempotent:
# skipped while the binary is newer than this script; uses GOMODCACHE/GOCACHE.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=3.14.0
MODULE_VERSION=v0.314.0
OUT="$REPO/.tools/prometheus3"
BIN="$OUT/prometheus"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"  # the generated module sits inside this git work tree

fresh() { [ -x "$BIN" ] && [ "$BIN" -nt "${BASH_SOURCE[0]}" ]; }

if [ -z "${FORCE:-}" ] && fresh; then echo "$BIN"; exit 0; fi

command -v go >/dev/null || { echo "tools/build-prometheus.sh: go is not installed" >&2; exit 1; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [ -z "${FORCE:-}" ] && fresh; then echo "$BIN"; exit 0; fi

# `go install module@version` refuses modules whose go.mod has replace directives, as Prometheus'
# does, so build from a scratch main module that requires it (with the same replace).
SRC="$OUT/src"
rm -rf "$SRC"
mkdir -p "$SRC"
cd "$SRC"
cat > go.mod <<EOF
module pdproxy.local/prometheus3

go 1.25

replace cloud.google.com/go => cloud.google.com/go v0.123.0
EOF
started=$SECONDS
echo "building Prometheus $VERSION from github.com/prometheus/prometheus $MODULE_VERSION" >&2
go get "github.com/prometheus/prometheus/cmd/prometheus@$MODULE_VERSION" >&2
LDFLAGS="-s -w -X github.com/prometheus/common/version.Version=$VERSION"
LDFLAGS+=" -X github.com/prometheus/common/version.Branch=module -X github.com/prometheus/common/version.Revision=$MODULE_VERSION"
go build -trimpath -tags netgo,remove_all_sd -ldflags "$LDFLAGS" -o "$BIN.tmp" github.com/prometheus/prometheus/cmd/prometheus >&2
mv -f "$BIN.tmp" "$BIN"
echo "built $BIN in $((SECONDS - started)) s" >&2
echo "$BIN"
