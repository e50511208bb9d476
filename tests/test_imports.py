"""pdproxy's modules import each other without a cycle, and the settings module is a leaf.

The graph is read from the source (every `import`, also the ones inside functions), so a lazy
import that reaches back up — the way `config.py` once started the server — is caught too.
An edge goes to the module named; importing `pdproxy.a.b` also runs `pdproxy/a/__init__.py`,
but that implicit edge is left out: Python handles a package importing its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdproxy

ROOT = Path(pdproxy.__file__).parent


def module_names() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = module_names()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from a import b`: the submodule a.b when there is one, else a itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[mod].update(t for t in targets if t in mods and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_lazy_imports() -> None:
    """The walker must see imports inside functions, or the cycle check proves nothing."""
    graph = import_graph()
    assert "pdproxy.server" in graph["pdproxy.serve_cli"]  # imported inside run(), after the settings load
    assert "pdproxy.config" in graph["pdproxy.server"]


def test_no_import_cycle_among_pdproxy_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_settings_module_is_a_leaf() -> None:
    """Everything below the CLI may read the settings; the settings reach back to nothing of pdproxy."""
    assert import_graph()["pdproxy.config"] == set()


def test_find_cycle_reports_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def package_graph() -> dict[str, set[str]]:
    """The graph between pdproxy's subpackages (and top-level modules): `pdproxy.a.b` counts as `pdproxy.a`."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        out.setdefault(top(mod), set()).update(top(t) for t in targets if top(t) != top(mod))
    return out


def test_routing_policies_and_kv_events_do_not_import_each_other() -> None:
    """The block hashing they share lives below them (pdproxy.blocks); routing is above both."""
    graph = package_graph()
    assert "pdproxy.policies" not in graph["pdproxy.kvevents"] and "pdproxy.routing" not in graph["pdproxy.kvevents"]
    assert "pdproxy.kvevents" not in graph["pdproxy.policies"] and "pdproxy.routing" not in graph["pdproxy.policies"]
    assert graph["pdproxy.blocks"] == set()


def test_no_import_cycle_among_pdproxy_packages() -> None:
    """A subsystem is a package with one face: no two packages reach into each other, even through a third."""
    cycle = find_cycle(package_graph())
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)
