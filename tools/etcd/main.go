// etcd for the Kubernetes discovery tests: the server's own entry point, built as a module of
// this repository because etcd's go.mod carries replace directives (`go install …@version` refuses it).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
