#!/usr/bin/env bash
# Build tools/grafana-schema (Go; Grafana's foundation SDK, Apache-2.0, pinned by its go.mod to v0.0.22)
# into <repo>/.tools/grafana-schema/grafana-schema, and print the binary's path.
#
# tests/test_grafana_schema.py runs it on every generated dashboard: each must decode strictly
# against Grafana's own dashboard and panel schemas (Grafana itself cannot run in the tests). Only
# the panel plugins the dashboards use are compiled in, so a cold build is a few hundred packages
# fewer than the SDK's whole. Cached and locked as tools/gobuild.sh says.
set -euo pipefail
source "$(dirname "$0")/gobuild.sh"
gobuild grafana-schema . github.com/grafana/grafana-foundation-sdk/go -ldflags='-s -w'
