// kube-apiserver for the Kubernetes discovery tests: the upstream command (the entry k3s and
// MicroShift embed), built from the k8s.io/kubernetes module at the release go.mod pins.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() { os.Exit(cli.Run(app.NewAPIServerCommand())) }
