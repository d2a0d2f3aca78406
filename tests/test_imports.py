"""The package's layering: no import cycles, no upward imports, no private names across packages.

Every ``import megatron_lol.X`` / ``from megatron_lol.X import`` in the package,
at module level or inside a function, is an edge between two subpackages (or
top-level modules). Each unit sits on a layer of :data:`LAYERS`; an edge may
only point to the same layer or one below, so each layer can be read, tested
and replaced without the ones above it (and the graph is acyclic). A name with a
leading underscore is private to its subpackage: importing it from another one
makes that helper an API nobody maintains as one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_lol"


# bottom to top; a unit may import units of its own layer or of the layers below
LAYERS = (
    # megatron_import: run by the package's __init__ before anything imports megatron-core
    # convert.hf_modeling: the HF remote code, shipped with every export, imports torch only; the
    # megatron-core side calls its per-pass parts (parts_lol) so both compute them one way
    ("errors", "checks", "log", "process_guard", "progress", "megatron_import", "convert.hf_modeling"),
    ("plan", "platform"),
    ("backends", "parallel", "data"),
    ("config",),
    ("model",),
    ("perf",),
    ("training",),
    ("convert",),
    ("inference",),
    ("analysis",),
    ("cli", "__main__"),
)
LAYER_OF = {f"megatron_lol.{name}": level for level, names in enumerate(LAYERS) for name in names}


def _unit(module: str) -> str:
    parts = module.split(".")
    if parts[:3] == ["megatron_lol", "convert", "hf_modeling"]:
        return ".".join(parts[:3])
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
                return stack[stack.index(nxt) :] + [nxt]
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


def upward_imports(edges: dict) -> list:
    """``(importer, imported)`` pairs where the imported unit sits on a higher layer."""
    return sorted((a, b) for a, targets in edges.items() for b in targets if LAYER_OF[b] > LAYER_OF[a])


def test_every_unit_has_a_layer():
    units = {_unit(".".join(p.relative_to(PKG.parent).with_suffix("").parts)) for p in PKG.rglob("*.py")}
    units.discard("megatron_lol.__init__")
    assert units <= set(LAYER_OF), f"add to LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_package_imports_one_above_it():
    assert upward_imports(import_graph()) == []


def test_a_planted_upward_import_is_found():
    edges = import_graph()
    edges["megatron_lol.model"].add("megatron_lol.training")  # as if model/ imported the trainer
    assert ("megatron_lol.model", "megatron_lol.training") in upward_imports(edges)


def private_imports_across_packages() -> list:
    """``(file, module, name)`` for every ``from megatron_lol.X import _name`` from outside X's unit."""
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        source = _unit(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megatron_lol"):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and _unit(node.module) != source:
                        found.append((str(rel), node.module, alias.name))
    return found


def test_no_private_name_is_imported_across_packages():
    assert private_imports_across_packages() == []


def test_a_cycle_is_detected():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize(
    "package",
    [
        "errors",
        "log",
        "plan",
        "config",
        "backends",
        "parallel",
        "model",
        "data",
        "perf",
        "training",
        "convert",
        "analysis",
        "cli",
    ],
)
def test_each_package_imports_alone(package):
    proc = subprocess.run(
        [sys.executable, "-c", f"import megatron_lol.{package}"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def long_positional_signatures(limit: int = 8) -> list:
    """``(file, line, function, count)`` of every function taking more than ``limit`` positional
    parameters (``self`` included; keyword-only ones are free): past that, a call site cannot be
    read without the signature beside it."""
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = len(node.args.posonlyargs) + len(node.args.args)
                if count > limit:
                    found.append((str(path.relative_to(PKG.parent)), node.lineno, node.name, count))
    return found


def test_no_function_takes_more_than_eight_positional_parameters():
    assert long_positional_signatures() == []


#: the longest a module of the package may be (CONTRIBUTING.md: split along a line a reader would draw)
MAX_MODULE_LINES = 600


def test_no_module_of_the_package_is_longer_than_the_limit():
    long = {
        str(path.relative_to(PKG.parent)): n
        for path in PKG.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
