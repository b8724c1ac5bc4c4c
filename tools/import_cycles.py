"""Print the import cycles among llminfer's modules, counting every import: module level, inside functions
and under ``if TYPE_CHECKING:``.

    python tools/import_cycles.py            # one line per strongly connected component of size > 1
    python tools/import_cycles.py --edges    # and the edges inside each

Exit status 1 when there is a cycle, so a test or CI can hold the line. A package's ``__init__`` counts as
the package itself; ``from pkg import name`` counts as an edge to ``pkg.name`` when that is a module.

Importable without side effects (``tests/test_code_shape.py`` loads it by path and calls :func:`cycles`); it
stays out of the installed package because only development needs it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "llminfer"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``dotted name -> file`` for every module of the package under ``root``."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]  # `import a.b.c` imports a.b too; resolve to a module
            if target and target != name:
                found.add(target)
                break  # the longest module named is the edge; its parents are not separate edges
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (Tarjan 1972), iterative; components of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` (every import, see :func:`imports_of`), for the
    package under ``root`` (a ``src`` folder)."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(root: Path = ROOT) -> list[list[str]]:
    """The import cycles of the package under ``root``: each strongly connected component of more than one
    module, as a sorted list of dotted names; ``[]`` when the graph is acyclic."""
    return strongly_connected(import_graph(root))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print the edges inside each cycle")
    args = parser.parse_args()
    graph = import_graph()
    cycles = strongly_connected(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges, {len(cycles)} cycles")
    for component in cycles:
        print(f"cycle of {len(component)}: {' '.join(component)}")
        if args.edges:
            members = set(component)
            for name in component:
                for target in sorted(graph[name] & members):
                    print(f"    {name} -> {target}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
