#!/usr/bin/env bash
# Build etcd 3.6 (Apache-2.0) from its Go module into <repo>/.tools/etcd/etcd, and print the binary's path.
#
# The Kubernetes discovery tests run a real kube-apiserver (tools/build-kube-apiserver.sh) on this etcd.
# tools/etcd/main.go calls the server's own entry point (etcd's go.mod has replace directives, so
# `go install …@version` refuses it); go.mod pins go.etcd.io/etcd/server/v3 v3.6.16. A cold build takes a
# minute or two on 2 cores.
set -euo pipefail
source "$(dirname "$0")/gobuild.sh"
gobuild etcd . go.etcd.io/etcd/server/v3 -ldflags='-s -w'
