#!/usr/bin/env bash
# Build Jaeger v2 (Apache-2.0; a Collector distribution with an in-memory trace store and a query
# API) from its Go module into <repo>/.tools/jaeger/jaeger, and print the binary's path.
#
# The tests use it as the trace store that tail-sampled traces land in (tests/test_trace_store.py).
# The version is pinned by tools/jaeger/go.mod (`go get -tool ...@v1.76.0`, i.e. Jaeger v2.13.0,
# the release deploy/compose.yaml's jaegertracing/jaeger image is). Idempotent: nothing is rebuilt
# when the binary is newer than go.mod/go.sum; Go's module and build caches are reused, so a
# rebuild after a cache hit takes seconds. No binary is committed (.tools/ is git-ignored).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
module="$repo/tools/jaeger"
out="$repo/.tools/jaeger/jaeger"

export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

fresh() { [ -x "$out" ] && [ "$out" -nt "$module/go.mod" ] && [ "$out" -nt "$module/go.sum" ] && [ "$out" -nt "$repo/tools/build-jaeger.sh" ]; }

if fresh; then echo "$out"; exit 0; fi

command -v go >/dev/null || { echo "build-jaeger: 'go' not found (Go >= 1.24.6 is needed)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9  # one build at a time (CI's background build and a test); the others find it fresh
if fresh; then echo "$out"; exit 0; fi
cd "$module"
started=$SECONDS
echo "building Jaeger $(go list -m -f '{{.Version}}' github.com/jaegertracing/jaeger); a cold build compiles ~2300 packages" >&2
# -trimpath: the same build-cache keys wherever the repo is; no symbol tables: a smaller binary.
# No compiler optimisation or inlining (-N -l): a third less CPU for the cold build (~2300
# packages, a third of them the Elasticsearch client, which no build tag leaves out), and this
# store only ever holds test and development traffic.
go build -trimpath -gcflags='all=-N -l' -ldflags='-s -w' -o "$out.tmp" github.com/jaegertracing/jaeger/cmd/jaeger >&2
mv -f "$out.tmp" "$out"
echo "built $out in $((SECONDS - started)) s" >&2
echo "$out"
