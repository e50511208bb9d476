#!/usr/bin/env bash
# Build kube-apiserver v1.36 (Apache-2.0) from the k8s.io/kubernetes Go module into
# <repo>/.tools/kube-apiserver/kube-apiserver, and print the binary's path.
#
# The Kubernetes discovery tests run it on a real etcd (tools/build-etcd.sh): no kubelet, the tests create Pods
# and patch their status themselves. k8s.io/kubernetes is not meant to be consumed as a module:
# tools/kube-apiserver/go.mod requires it at v1.36.3 and replaces each staging module it requires at v0.0.0 with
# the same release (v0.36.3); main.go calls app.NewAPIServerCommand(). Compiled without optimisation (-N -l),
# which cuts the cold build's CPU by about a third: it only ever serves the tests' few objects. A cold build
# takes about 8 minutes on 2 cores.
set -euo pipefail
source "$(dirname "$0")/gobuild.sh"
version="$(cd "$(dirname "$0")/kube-apiserver" && GOTOOLCHAIN=local GOFLAGS=-buildvcs=false go list -m -f '{{.Version}}' k8s.io/kubernetes)"
minor="${version#v1.}"; minor="${minor%%.*}"
# the version it reports (otherwise v0.0.0-master, which clients warn about)
gobuild kube-apiserver . k8s.io/kubernetes -gcflags='all=-N -l' -ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
