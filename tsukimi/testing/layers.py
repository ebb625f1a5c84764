"""The package's structure check: the import graph of every module under tsukimi/, its cycles,
and every import that goes from a lower layer to a higher one.

Layers, bottom (0) up, by the top-level module or package under tsukimi/; a module may import
from its own layer or any lower one, never from a higher one:

    0  clock, errors, eviction, config,     (foundation: no tsukimi imports above it)
       retry, lifeline, extras, quantiles, owners
    1  netio, auth, netserver, rpc, httpd,  (sockets, the greeting, the control plane;
       device                               device memory: GPUs, emulated)
    2  transfer                             (the Transfer Engine)
    3  store, scheduler, p2p
    4  engine, sim
    5  serving, compat
    6  integrations                         (vLLM and SGLang plug-ins)
    7  lab                                  (emulated hosts: namespaces) }
    8  testing                              (this kit)                   } tooling
    9  bench                                                             }
   10  cli, demo, __main__, __init__        (__init__: tsukimi/__init__.py itself)

The product and its tooling are apart: no module outside lab/, testing/ and bench/ imports them,
except the top-level `cli` and `demo`, which dispatch to them (TOOLING, DISPATCHERS). The layers
already keep every lower layer off them; this rule says so for the top layer too (`__init__`,
`__main__`), whatever the order of LAYERS becomes.

Every import statement counts: at module level, inside functions, and under
`if TYPE_CHECKING:` (a cycle hidden there is still a cycle between the two modules' designs).
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (its
`__init__`); relative imports resolve the same way. A submodule has no implicit edge to its
parent package (else every re-exporting `__init__` would be a cycle). A top-level name that
is in no layer is itself a problem: a new package must be given a place.

Run it: `python -m tsukimi.testing.layers [PACKAGE_DIR]` exits 1 with a report, or 0 with
one OK line. Import it: `check_layers(root)` returns the problems.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"clock", "errors", "eviction", "config", "retry", "lifeline", "extras", "quantiles", "owners"}),
    frozenset({"netio", "auth", "netserver", "rpc", "httpd", "device"}),
    frozenset({"transfer"}),
    frozenset({"store", "scheduler", "p2p"}),
    frozenset({"engine", "sim"}),
    frozenset({"serving", "compat"}),
    frozenset({"integrations"}),
    frozenset({"lab"}),
    frozenset({"testing"}),
    frozenset({"bench"}),
    frozenset({"cli", "demo", "__main__", "__init__"}),
)
RANK: dict[str, int] = {name: rank for rank, names in enumerate(LAYERS) for name in names}
TOOLING = frozenset({"lab", "testing", "bench"})  # the lab, the test kit, the benchmarks: never imported by the product
DISPATCHERS = frozenset({"cli", "demo"})  # the commands that run them (`tsukimi bench`, `tsukimi demo`)


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding: `kind` says which rule; `message` names the modules, files and lines."""

    kind: Literal["cycle", "layer", "tooling", "unknown"]
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True, slots=True)
class ImportEdge:
    """`importer` imports `imported` (both dotted module names) at `path`:`line`."""

    importer: str
    imported: str
    path: str
    line: int


@dataclass(frozen=True, slots=True)
class ImportGraph:
    """Every module of a package (dotted name -> file) and the edges between them."""

    modules: dict[str, Path]
    edges: tuple[ImportEdge, ...]

    def successors(self) -> dict[str, set[str]]:
        """Module -> the modules it imports (self-imports left out)."""
        out: dict[str, set[str]] = {name: set() for name in self.modules}
        for edge in self.edges:
            if edge.imported != edge.importer:
                out[edge.importer].add(edge.imported)
        return out


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`
    (`root/__init__.py` is the package itself, named `root.name`)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of the package, if any."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module `from ... import` names, for relative imports too."""
    if node.level == 0:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> Iterator[str]:
    """The package's modules one import statement depends on."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (target := _resolve(alias.name, modules)) is not None:
                yield target
        return
    base = _from_base(module, path, node)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in modules else _resolve(base, modules)
        if target is not None:
            yield target


def build_graph(root: Path) -> ImportGraph:
    """Parse every module under the package directory `root`; every import statement
    (module level, in functions, under TYPE_CHECKING) becomes an edge."""
    modules = find_modules(root)
    edges: list[ImportEdge] = []
    for module, path in modules.items():
        shown = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.extend(ImportEdge(module, t, shown, node.lineno) for t in _targets(module, path, node, modules))
    return ImportGraph(modules, tuple(edges))


def layer_of(module: str) -> str:
    """The top-level name that places `module` in a layer (`__init__` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def strongly_connected(successors: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(successors):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(successors[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(successors[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def shortest_cycle(start: str, members: set[str], successors: dict[str, set[str]]) -> list[str]:
    """A shortest import path from `start` back to itself inside one component (breadth first)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(successors[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in a component but on no cycle")


def _cycle_problems(graph: ImportGraph) -> list[Problem]:
    successors = graph.successors()
    first_line: dict[tuple[str, str], str] = {}  # (importer, imported) -> its first import's place
    for edge in reversed(graph.edges):
        first_line[edge.importer, edge.imported] = f"{edge.path}:{edge.line}"
    problems: list[Problem] = []
    for component in strongly_connected(successors):
        if len(component) < 2:
            continue
        cycle = shortest_cycle(component[0], set(component), successors)
        where = ", ".join(first_line[a, b] for a, b in itertools.pairwise(cycle))
        extra = f" (the cycle's component: {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
        problems.append(Problem("cycle", f"{' -> '.join(cycle)}  [{where}]{extra}"))
    return problems


def _layer_problems(graph: ImportGraph) -> list[Problem]:
    problems: list[Problem] = []
    unknown = sorted({layer_of(m) for m in graph.modules} - RANK.keys())
    for name in unknown:
        files = sorted(str(p) for m, p in graph.modules.items() if layer_of(m) == name)
        problems.append(
            Problem(
                "unknown", f"{name!r} is in no layer ({files[0]}...): add it to LAYERS in tsukimi/testing/layers.py"
            )
        )
    seen: set[tuple[str, str]] = set()
    for edge in graph.edges:
        low, high = layer_of(edge.importer), layer_of(edge.imported)
        if low in unknown or high in unknown or RANK[low] >= RANK[high] or (edge.importer, edge.imported) in seen:
            continue
        if _imports_tooling(edge):  # NOTE: reported once, by the tooling rule, which says why
            continue
        seen.add((edge.importer, edge.imported))
        ranks = f"{low}, layer {RANK[low]} -> {high}, layer {RANK[high]}"
        problems.append(Problem("layer", f"{edge.path}:{edge.line} {edge.importer} imports {edge.imported} ({ranks})"))
    return problems


def _imports_tooling(edge: ImportEdge) -> bool:
    """Whether `edge` is the product importing lab, testing or bench."""
    return layer_of(edge.imported) in TOOLING and layer_of(edge.importer) not in TOOLING | DISPATCHERS


def _tooling_problems(graph: ImportGraph) -> list[Problem]:
    """Every import of lab, testing or bench by a module of the product (see the module)."""
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for edge in graph.edges:
        if not _imports_tooling(edge) or (edge.importer, edge.imported) in seen:
            continue
        seen.add((edge.importer, edge.imported))
        imported = layer_of(edge.imported)
        problems.append(
            Problem(
                "tooling",
                f"{edge.path}:{edge.line} {edge.importer} imports {edge.imported} "
                f"(the product never imports {imported}: only {', '.join(sorted(TOOLING | DISPATCHERS))} may)",
            )
        )
    return problems


def check_layers(root: Path | None = None) -> list[Problem]:
    """Every import cycle, upward import, import of the tooling by the product and unplaced
    top-level name in the package.

    Args:
        root: the package directory (default: the tsukimi/ this module belongs to).
    Returns:
        the problems, cycles first; empty when the structure is sound. Reads files only.
    """
    return problems_in(build_graph(root or Path(__file__).resolve().parents[1]))


def problems_in(graph: ImportGraph) -> list[Problem]:
    """The cycles, upward imports, imports of the tooling and unplaced names of an import
    graph, cycles first."""
    return _cycle_problems(graph) + _layer_problems(graph) + _tooling_problems(graph)


def main(argv: list[str] | None = None) -> int:
    """`python -m tsukimi.testing.layers [PACKAGE_DIR]`: print the report; 1 if any problem."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.testing.layers", description="tsukimi's structure check")
    parser.add_argument("root", nargs="?", type=Path, help="the package directory (default: tsukimi/)")
    args = parser.parse_args(argv)
    root = args.root or Path(__file__).resolve().parents[1]
    graph = build_graph(root)
    problems = problems_in(graph)
    if not problems:
        print(
            f"layers OK: {len(graph.modules)} modules, {len(graph.edges)} imports, no cycle, no upward import, "
            "no import of the tooling by the product"
        )
        return 0
    print(f"{len(problems)} structure problems in {root} ({len(graph.modules)} modules):")
    for problem in problems:
        print(f"  {problem}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
