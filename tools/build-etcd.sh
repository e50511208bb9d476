#!/usr/bin/env bash
# Build etcd 3.6 (Apache-2.0) from its Go module into <repo>/.tools/etcd/etcd, and print the binary's path.
#
# The Kubernetes discovery tests run a real kube-apiserver (tools/build-kube-apiserver.sh) on this
# etcd. tools/etcd/main.go calls the server's own entry point; go.mod pins go.etcd.io/etcd/server/v3
# v3.6.16. Idempotent: nothing is rebuilt while the binary is newer than the module and this script;
# Go's module and build caches are reused. A cold build takes about 4 minutes on 2 cores.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
module="$repo/tools/etcd"
out="$repo/.tools/etcd/etcd"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"  # the module sits inside this git work tree

fresh() {
  [ -x "$out" ] || return 1
  for f in "$module/go.mod" "$module/go.sum" "$module/main.go" "$repo/tools/build-etcd.sh"; do
    [ "$out" -nt "$f" ] || return 1
  done
}

if fresh; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "build-etcd: 'go' not found" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9  # one build at a time (CI's background build and a test); the others find it fresh
if fresh; then echo "$out"; exit 0; fi
cd "$module"
started=$SECONDS
echo "building etcd $(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)" >&2
go build -trimpath -ldflags='-s -w' -o "$out.tmp" . >&2
mv -f "$out.tmp" "$out"
echo "built $out in $((SECONDS - started)) s" >&2
echo "$out"
