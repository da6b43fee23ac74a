"""The package's imports point down the layer order of docs/DESIGN.md §1, without cycles.

The layer order is read from the code block in DESIGN §1 (top line = top
layer), so the picture there and this test cannot drift apart. Every import
in every module counts: top-level ones, those inside functions and those under
`if TYPE_CHECKING:` alike. `from pkg import name` counts as importing
`pkg.name` when that is a module of the package, else `pkg` itself; the
implicit import of a parent package's `__init__` is not counted (Python runs
it first, but it is a facade, not a dependency). Dynamic imports
(`importlib.import_module` in cli/main.py) are invisible to this test.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "zonefs_py"
DESIGN = REPO / "docs" / "DESIGN.md"
ROOT = "zonefs_py"

Graph = dict[str, set[str]]


# -- reading the code and the design -------------------------------------------------

def module_name(path: Path) -> str:
    """Dotted module name of a file of the package (a package is its `__init__`)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """Modules of the package that `module` imports anywhere in its source."""
    known = set(known)
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve_relative(module, path.name == "__init__.py", node.level,
                                           node.module)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m == ROOT or m.startswith(ROOT + ".")} - {module}


def import_graph() -> Graph:
    mods = package_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def design_layers(text: str) -> list[list[str]]:
    """Module prefixes per layer, bottom layer first, from the code block of DESIGN §1."""
    section = re.search(r"^## 1\. .*?$(.*?)^## 2\. ", text, re.M | re.S)
    assert section, "DESIGN.md has no section 1"
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "DESIGN.md §1 has no code block with the layers"
    layers = []
    for line in block.group(1).splitlines():
        paths = re.findall(r"zonefs_py(?:/[\w.]+)*", line.split("  ")[0])
        if paths:
            layers.append([p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                           for p in paths])
    return layers[::-1]


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index (0 = bottom) of the layer whose longest prefix names `module`."""
    best: tuple[int, int] | None = None
    for idx, prefixes in enumerate(layers):
        for prefix in prefixes:
            names_it = module == prefix or (module.startswith(prefix + ".") and prefix != ROOT)
            if names_it and (best is None or len(prefix) > best[0]):
                best = (len(prefix), idx)
    return None if best is None else best[1]


# -- the checks ------------------------------------------------------------------------

def upward_imports(graph: Mapping[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Imports from a module into a higher layer, and modules in no layer."""
    problems = []
    for mod in sorted(graph):
        here = layer_of(mod, layers)
        if here is None:
            problems.append(f"{mod} is in no layer of DESIGN §1")
            continue
        for dep in sorted(graph[mod]):
            there = layer_of(dep, layers)
            if there is None:
                problems.append(f"{mod} imports {dep}, which is in no layer of DESIGN §1")
            elif there > here:
                problems.append(f"{mod} (layer {'/'.join(layers[here])}) imports {dep} "
                                f"(layer {'/'.join(layers[there])}, above it)")
    return problems


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


# -- tests -----------------------------------------------------------------------------

def test_no_import_cycles() -> None:
    assert import_cycles(import_graph()) == []


def test_imports_only_point_down_the_design_layers() -> None:
    assert upward_imports(import_graph(), design_layers(DESIGN.read_text())) == []


def test_design_layers_are_read_as_written() -> None:
    layers = design_layers(DESIGN.read_text())
    order = [prefix for layer in layers for prefix in layer]
    assert order.index("zonefs_py.device") < order.index("zonefs_py.journal") \
        < order.index("zonefs_py.cleaner") < order.index("zonefs_py.fs") \
        < order.index("zonefs_py.fuse_ops") < order.index("zonefs_py.cli")
    assert layer_of("zonefs_py.fs.filesystem", layers) == layer_of("zonefs_py.fs", layers)
    assert layer_of("zonefs_py.fsck", layers) != layer_of("zonefs_py.fs", layers)


def test_the_walker_sees_imports_inside_functions_and_type_checking() -> None:
    graph = import_graph()
    # fsck's repair imports ZoneFS inside a function; the allocator imports the model
    # at the top.
    assert "zonefs_py.fs.filesystem" in graph["zonefs_py.fsck.repair"]
    assert "zonefs_py.model.state" in graph["zonefs_py.alloc.allocator"]
    # `from zonefs_py.device import native` is an import of the submodule.
    assert "zonefs_py.device.native" in graph["zonefs_py.device.blockdev"]


def test_checks_flag_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    src = tmp_path / "zonefs_py" / "journal"
    src.mkdir(parents=True)
    (src / "x.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from zonefs_py.fs import y\n"
                              "def f():\n    from . import log\n")
    known = {"zonefs_py.fs.y", "zonefs_py.journal.log"}
    deps = imports_of("zonefs_py.journal.x", src / "x.py", known)
    assert deps == {"zonefs_py.fs.y", "zonefs_py.journal.log"}
    layers = [["zonefs_py.journal"], ["zonefs_py.fs"]]
    graph = {"zonefs_py.journal.x": deps, "zonefs_py.fs.y": {"zonefs_py.journal.x"},
             "zonefs_py.journal.log": set()}
    problems = upward_imports(graph, layers)
    assert len(problems) == 1
    assert "zonefs_py.journal.x" in problems[0]
    assert import_cycles(graph) == [["zonefs_py.fs.y", "zonefs_py.journal.x"]]


@pytest.mark.parametrize("module", ["zonefs_py.cleaner.cleaner", "zonefs_py.device.emu_faults"])
def test_former_cycle_ends_import_nothing_above_them(module: str) -> None:
    """The two cycles of issue 17: the cleaner and the fault injector stand alone."""
    deps = import_graph()[module]
    assert not {d for d in deps if d.startswith(("zonefs_py.fs", "zonefs_py.device.emulated"))}


# -- private names stay inside their package --------------------------------------------
#
# `obj._name` in a module of package P (a subpackage such as `fs`, or a top-level
# module such as `fsck`) is an access to another package's private name unless
# `obj` is `self` / `cls`, or `_name` is defined somewhere in P (a def, a class, an
# assignment to `_name` or `x._name`, or a `__slots__` entry): private names are
# package-private. A name defined both in P and elsewhere is not caught (the check
# reads no types); dunders are not private names.

#: Private names of the standard library's public API (namedtuple, os, argparse).
STDLIB_PRIVATE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_exit",
                                "_SubParsersAction"})


def package_of(module: str) -> str:
    """`zonefs_py.fs.data.datapath` -> `fs`; `zonefs_py.fsck` -> `fsck`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def private_names_defined(tree: ast.AST) -> set[str]:
    """Private names a module defines (see the comment above)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            out.update(c.value for c in ast.walk(node.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def foreign_private_accesses(sources: Mapping[str, str]) -> list[str]:
    """`module:line: expr` for each access to another package's private name."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    defined: dict[str, set[str]] = {}
    for mod, tree in trees.items():
        defined.setdefault(package_of(mod), set()).update(private_names_defined(tree))
    problems = []
    for mod, tree in sorted(trees.items()):
        own = defined[package_of(mod)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__") or node.attr in STDLIB_PRIVATE_API:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                problems.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    return problems


def test_no_module_uses_another_packages_private_names() -> None:
    sources = {m: p.read_text() for m, p in package_modules().items()}
    assert foreign_private_accesses(sources) == []


def test_private_check_flags_a_reach_into_another_package() -> None:
    sources = {
        "zonefs_py.fs.filesystem": "class ZoneFS:\n    def _txn(self, ops):\n        pass\n",
        "zonefs_py.fs.prealloc": "def f(fs):\n    fs._txn([])\n",  # same package: fine
        "zonefs_py.drain.manager": ("class M:\n    def __init__(self, fs):\n"
                                    "        self.fs = fs\n        self._own = 1\n"
                                    "    def g(self, other):\n        self.fs._txn([])\n"
                                    "        other._own\n        self._other()\n"
                                    "        return p._replace(a=1)\n"),
    }
    assert foreign_private_accesses(sources) == ["zonefs_py.drain.manager:6: self.fs._txn"]
