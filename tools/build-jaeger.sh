#!/usr/bin/env bash
# Build Jaeger v2 (Apache-2.0; a Collector distribution with an in-memory trace store and a query
# API) from its Go module into <repo>/.tools/jaeger/jaeger, and print the binary's path.
#
# The tests use it as the trace store that tail-sampled traces land in (tests/test_trace_store.py).
# The version is pinned by tools/jaeger/go.mod (`go get -tool ...@v1.76.0`, i.e. Jaeger v2.13.0,
# the release deploy/compose.yaml's jaegertracing/jaeger image is). No binary is committed (.tools/ is
# git-ignored). No compiler optimisation or inlining (-N -l): a third less CPU for the cold build (~2300
# packages, a third of them the Elasticsearch client, which no build tag leaves out), and this store only
# ever holds test and development traffic. Cached and locked as tools/gobuild.sh says.
set -euo pipefail
source "$(dirname "$0")/gobuild.sh"
gobuild jaeger github.com/jaegertracing/jaeger/cmd/jaeger github.com/jaegertracing/jaeger -gcflags='all=-N -l' -ldflags='-s -w'
