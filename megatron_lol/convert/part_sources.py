"""Shipping the per-pass parts a LoL export uses but the remote code does not have.

The HF remote code (``hf_modeling/``, copied next to every export's config.json) imports torch only.
Its ``parts_lol.py`` holds the built-in parts; a part defined outside the package (a plug-in: a test's,
a research variant's) travels as the source of its class: :func:`write_part_sources` writes each
into ``part_<name>.py`` (headed by the imports a part's class may use: torch and ``parts_lol``'s
names) and rewrites ``plugin_parts_lol.py``, which ``modeling_lol.py`` imports and which registers
them, so the exported steps' part names resolve there as they do here (docs/convert.md, "Per-pass
parts"). Hugging Face's loader copies both with the remote code: they are relative imports.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import os
import textwrap

from megatron_lol.convert.hf_modeling import parts_lol
from megatron_lol.errors import CliError

#: what a shipped part's class may read besides its own names (the shipped module's imports)
SHIPPED_NAMES = frozenset({"torch", "annotations", "Optional"}) | {
    name for name in vars(parts_lol) if not name.startswith("_")
}

HEADER = '''"""Per-pass part {name!r}, shipped with this export: the source of {where}."""

from __future__ import annotations

from typing import Optional

import torch

from .parts_lol import *  # noqa: F403 (the names a part's class may use)
from .parts_lol import Part, register_part  # noqa: F401


'''

PLUGINS = '''"""The per-pass parts this export ships beside the built-in ones of parts_lol.py (written by the
exporter: megatron_lol/convert/part_sources.py)."""

from .parts_lol import register_part
{imports}
SHIPPED = ({names})
for _part in SHIPPED:
    register_part(_part)
'''


def plugin_parts(parts) -> list:
    """The parts of ``parts`` that the remote code does not define itself."""
    return [cls for cls in parts if cls not in parts_lol.BUILTIN_PARTS]


def class_source(cls: type) -> str:
    """The source of part ``cls``'s class; a one-line CliError when it reads a name of its module that the
    shipped file would not have (a helper function or constant beside it)."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as err:
        raise CliError(f"part {cls.name!r} ({where}): its source is needed for the HF export ({err})") from None
    tree = ast.parse(source)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in ast.walk(n) if isinstance(a, ast.arg)
    }
    bound |= {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda)) and hasattr(n, "name")
    }
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    missing = sorted(read - bound - SHIPPED_NAMES - set(dir(builtins)))
    if missing:
        raise CliError(
            f"part {cls.name!r} ({where}) reads {', '.join(missing)} from its module: a shipped part's class may "
            f"use torch and parts_lol's names only (docs/convert.md, 'Per-pass parts')"
        )
    return source


def write_part_sources(directory: str, parts) -> dict:
    """Write the plug-in parts among ``parts`` into ``directory`` (the export being written) and the
    ``plugin_parts_lol.py`` that registers them; returns ``{part name: module name}`` for config.json."""
    shipped = {}
    imports, names = [], []
    for cls in plugin_parts(parts):
        module = f"part_{cls.name.replace('-', '_')}"
        where = f"{cls.__module__}.{cls.__qualname__}"
        with open(os.path.join(directory, f"{module}.py"), "w") as f:
            f.write(HEADER.format(name=cls.name, where=where) + class_source(cls))
        imports.append(f"from .{module} import {cls.__name__}")
        names.append(cls.__name__ + ",")
        shipped[cls.name] = module
    if shipped:
        with open(os.path.join(directory, "plugin_parts_lol.py"), "w") as f:
            f.write(PLUGINS.format(imports="\n".join(imports) + "\n", names=" ".join(names)))
    return shipped
