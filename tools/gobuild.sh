# Sourced by tools/build-*.sh whose tool is a Go module of this repository (tools/<name>/go.mod): one way to
# decide whether the cached binary is fresh, to take the build's lock and to build.
#
#   gobuild NAME PACKAGE MODULE [go build flags...]
#
# builds PACKAGE (".", or a tool's import path) in tools/NAME into .tools/NAME/NAME and prints the binary's
# path; the log names MODULE's version, the one the tool is built from. Nothing is rebuilt while the binary is newer than the module's files and the calling script; Go's module
# and build caches are reused; one build at a time per tool (CI's background build and a test wait on the lock).

gobuild() {
  local name=$1 package=$2 upstream=$3; shift 3
  local repo module out script f
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  module="$repo/tools/$name"
  out="$repo/.tools/$name/$name"
  script="$(realpath "$0")"
  export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
  export GOFLAGS="${GOFLAGS:--buildvcs=false}"  # the modules sit inside this git work tree
  fresh() {
    [ -x "$out" ] || return 1
    for f in "$module"/go.mod "$module"/go.sum "$module"/*.go "$script"; do
      [ -e "$f" ] || continue
      [ "$out" -nt "$f" ] || return 1
    done
  }
  if fresh; then echo "$out"; return 0; fi
  command -v go >/dev/null || { echo "$(basename "$script"): 'go' not found" >&2; return 1; }
  mkdir -p "$(dirname "$out")"
  exec 9>"$out.lock"
  flock 9
  if fresh; then echo "$out"; return 0; fi
  cd "$module"
  local started=$SECONDS
  echo "building $name from $upstream $(go list -m -f '{{.Version}}' "$upstream")" >&2
  go build -trimpath "$@" -o "$out.tmp" "$package" >&2
  mv -f "$out.tmp" "$out"
  echo "built $out in $((SECONDS - started)) s" >&2
  echo "$out"
}
