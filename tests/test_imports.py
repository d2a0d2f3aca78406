"""The package's layering: no import cycles between its subpackages, and each imports alone.

Every ``import megatron_lol.X`` / ``from megatron_lol.X import`` in the package,
at module level or inside a function, is an edge between two subpackages (or
top-level modules); the graph must be acyclic, so each layer can be read,
tested and replaced without the ones above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_lol"


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def import_graph() -> dict:
    edges: dict = defaultdict(set)
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        source = _unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("megatron_lol.") and _unit(name) != source:
                    edges[source].add(_unit(name))
    return edges


def _cycle(edges: dict):
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_cycles_between_subpackages():
    edges = import_graph()
    assert edges["megatron_lol.model"], "the graph is empty: the scan is broken"
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_a_cycle_is_detected():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("package", ["errors", "log", "plan", "config", "backends", "parallel", "model", "data",
                                     "perf", "training", "convert", "analysis", "cli"])
def test_each_package_imports_alone(package):
    proc = subprocess.run([sys.executable, "-c", f"import megatron_lol.{package}"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
