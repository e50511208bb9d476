#!/usr/bin/env bash
# Build tools/grafana-schema (Go; Grafana's foundation SDK, Apache-2.0, pinned by its go.mod to v0.0.22)
# into <repo>/.tools/grafana-schema/grafana-schema, and print the binary's path.
#
# tests/test_grafana_schema.py runs it on every generated dashboard: each must decode strictly
# against Grafana's own dashboard and panel schemas (Grafana itself cannot run in the tests). Only
# the panel plugins the dashboards use are compiled in, so a cold build is a few hundred packages
# fewer than the SDK's whole. Idempotent: nothing is rebuilt while the binary is newer than the
# module's files and this script; Go's module and build caches are reused.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
module="$repo/tools/grafana-schema"
out="$repo/.tools/grafana-schema/grafana-schema"

export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"  # the module sits inside this git work tree

fresh() {
  [ -x "$out" ] || return 1
  for f in "$module/go.mod" "$module/go.sum" "$module/main.go" "$repo/tools/build-grafana-schema.sh"; do
    [ "$out" -nt "$f" ] || return 1
  done
}

if fresh; then echo "$out"; exit 0; fi

command -v go >/dev/null || { echo "build-grafana-schema: 'go' not found" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9  # one build at a time (CI's background build and a test); the others find it fresh
if fresh; then echo "$out"; exit 0; fi
cd "$module"
started=$SECONDS
echo "building grafana-schema (github.com/grafana/grafana-foundation-sdk/go $(go list -m -f '{{.Version}}' github.com/grafana/grafana-foundation-sdk/go))" >&2
go build -trimpath -ldflags='-s -w' -o "$out.tmp" . >&2
mv -f "$out.tmp" "$out"
echo "built $out in $((SECONDS - started)) s" >&2
echo "$out"
