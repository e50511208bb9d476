#!/usr/bin/env bash
# Build kube-apiserver v1.36 (Apache-2.0) from the k8s.io/kubernetes Go module into
# <repo>/.tools/kube-apiserver/kube-apiserver, and print the binary's path.
#
# The Kubernetes discovery tests run it on a real etcd (tools/build-etcd.sh): no kubelet, the tests
# create Pods and patch their status themselves. k8s.io/kubernetes is not meant to be consumed as a
# module: tools/kube-apiserver/go.mod requires it at v1.36.3 and replaces each staging module it
# requires at v0.0.0 with the same release (v0.36.3); main.go calls app.NewAPIServerCommand().
# Compiled without optimisation (-N -l), which cuts the cold build's CPU by about a third: it only
# ever serves the tests' few objects. A cold build takes about 9 minutes on 2 cores; idempotent and
# cached like the other tools.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
module="$repo/tools/kube-apiserver"
out="$repo/.tools/kube-apiserver/kube-apiserver"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

fresh() {
  [ -x "$out" ] || return 1
  for f in "$module/go.mod" "$module/go.sum" "$module/main.go" "$repo/tools/build-kube-apiserver.sh"; do
    [ "$out" -nt "$f" ] || return 1
  done
}

if fresh; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "build-kube-apiserver: 'go' not found" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9
if fresh; then echo "$out"; exit 0; fi
cd "$module"
started=$SECONDS
version="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
echo "building kube-apiserver $version" >&2
# the version the binary reports (otherwise v0.0.0-master, which clients warn about)
minor="${version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version"
ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
go build -trimpath -gcflags='all=-N -l' -ldflags="$ldflags" -o "$out.tmp" . >&2
mv -f "$out.tmp" "$out"
echo "built $out in $((SECONDS - started)) s" >&2
echo "$out"
