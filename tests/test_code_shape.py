"""The code's shape, held (issue 37): the scheduler's planning function fits one screen, no module under
``src/`` is over 450 lines (C++ over 600), the package's import graph has no cycle (every import counted:
module level, inside functions, under ``TYPE_CHECKING``; ``tools/import_cycles.py`` builds the graph), and
the HTTP routes build ``SamplingParams`` in one place (``api/sampling.py``).

Each check is a small function run twice: on the real tree, and on a made-up tree in ``tmp_path`` that breaks
it, so a check that could never fail would show here."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

from llminfer.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PY_MAX_LINES = 450
CPP_MAX_LINES = 600
CPP_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")


def _function_lines(func) -> int:
    node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    return node.end_lineno - node.lineno + 1


def test_schedule_is_at_most_60_lines():
    assert _function_lines(Scheduler.schedule) <= 60


# ---------------------------------------------------------------------------- module sizes
def oversized(root: Path, suffixes: tuple[str, ...], limit: int) -> list[str]:
    """``"path: N lines"`` for every file under ``root`` ending in one of ``suffixes`` with more than
    ``limit`` lines, longest first (paths relative to ``root``'s parent)."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes):
        lines = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if lines > limit:
            found.append((lines, path.relative_to(root.parent).as_posix()))
    return [f"{name}: {lines} lines" for lines, name in sorted(found, key=lambda x: (-x[0], x[1]))]


def test_no_python_module_over_450_lines():
    offenders = oversized(SRC, (".py",), PY_MAX_LINES)
    assert not offenders, f"Python modules over {PY_MAX_LINES} lines (split them by responsibility):\n" + \
        "\n".join(offenders)


def test_no_cpp_file_over_600_lines():
    offenders = oversized(SRC, CPP_SUFFIXES, CPP_MAX_LINES)
    assert not offenders, f"C++ files over {CPP_MAX_LINES} lines (one file per op):\n" + "\n".join(offenders)


def test_the_size_check_finds_a_long_module(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "csrc").mkdir(parents=True)
    (src / "pkg" / "short.py").write_text("x = 1\n" * PY_MAX_LINES)
    (src / "pkg" / "long.py").write_text("x = 1\n" * (PY_MAX_LINES + 1))
    (src / "pkg" / "csrc" / "op.cpp").write_text("int x;\n" * (CPP_MAX_LINES + 1))
    assert oversized(src, (".py",), PY_MAX_LINES) == [f"src/pkg/long.py: {PY_MAX_LINES + 1} lines"]
    assert oversized(src, CPP_SUFFIXES, CPP_MAX_LINES) == [f"src/pkg/csrc/op.cpp: {CPP_MAX_LINES + 1} lines"]


# ---------------------------------------------------------------------------- import cycles
def _load_tool():
    if "import_cycles" not in sys.modules:
        spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["import_cycles"] = module
        spec.loader.exec_module(module)
    return sys.modules["import_cycles"]


def test_no_import_cycle():
    found = _load_tool().cycles(SRC)
    assert not found, "import cycles (python tools/import_cycles.py --edges shows the edges):\n" + \
        "\n".join(" ".join(c) for c in found)


def test_import_cycle_tool_finds_a_cycle_through_a_function_local_import(tmp_path):
    tool = _load_tool()
    pkg = tmp_path / "llminfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from llminfer.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from llminfer import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "d.py").write_text("import llminfer.a\n")
    assert tool.strongly_connected(tool.import_graph(tmp_path)) == [["llminfer.a", "llminfer.b", "llminfer.c"]]
    assert tool.cycles(tmp_path) == [["llminfer.a", "llminfer.b", "llminfer.c"]]
    (pkg / "c.py").write_text("")
    assert tool.cycles(tmp_path) == []


# ---------------------------------------------------------------------------- one sampling builder over HTTP
def sampling_params_builders(api_dir: Path) -> dict[str, list[str]]:
    """``module file name -> the functions in it`` that call ``SamplingParams(...)`` (or
    ``something.SamplingParams(...)``), for the modules of ``api_dir``; ``<module>`` for a call outside any
    function."""
    found: dict[str, list[str]] = {}

    def visit(node: ast.AST, where: str, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                func = child.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) \
                    else None
                if called == "SamplingParams":
                    found.setdefault(name, []).append(inner)
            visit(child, inner, name)

    for path in sorted(api_dir.glob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "<module>", path.name)
    return found


#: The one HTTP sampling builder: ``api/sampling.py``'s ``sampling_kwargs`` maps any body (chat, completions,
#: responses) onto ``SamplingParams`` fields, which ``build_request`` validates into ``SamplingParams``.
HTTP_BUILDER = ("sampling.py", "sampling_kwargs")
HTTP_ROUTES = ("chat.py", "completions.py", "responses.py")


def http_builder_problems(api_dir: Path) -> list[str]:
    """What breaks "one sampling builder for the HTTP routes" in ``api_dir``: a module other than
    :data:`HTTP_BUILDER`'s that calls ``SamplingParams(...)``, a second definition of the builder, or a route
    module that does not call it."""
    problems = [f"{module} calls SamplingParams(...) in {funcs}"
                for module, funcs in sampling_params_builders(api_dir).items() if module != HTTP_BUILDER[0]]
    defined, calls = [], {}
    for path in sorted(api_dir.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == HTTP_BUILDER[1]:
                defined.append(path.name)
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == HTTP_BUILDER[1]:
                    calls[path.name] = True
    if defined != [HTTP_BUILDER[0]]:
        problems.append(f"{HTTP_BUILDER[1]} is defined in {defined or 'no module'}, not only in {HTTP_BUILDER[0]}")
    problems += [f"{route} does not call {HTTP_BUILDER[1]}" for route in HTTP_ROUTES
                 if (api_dir / route).exists() and route not in calls]
    return problems


def test_http_routes_build_sampling_params_in_one_module():
    assert http_builder_problems(SRC / "llminfer" / "api") == []


def test_the_one_builder_check_can_fail(tmp_path):
    (tmp_path / "sampling.py").write_text("def sampling_kwargs(body):\n    return {}\n")
    (tmp_path / "chat.py").write_text("from sampling import sampling_kwargs\n\ndef route(b):\n    return sampling_kwargs(b)\n")
    assert http_builder_problems(tmp_path) == []
    (tmp_path / "completions.py").write_text("def route(b):\n    return SamplingParams(top_k=b)\n")
    (tmp_path / "responses.py").write_text("def sampling_kwargs(body):\n    return {}\n")
    assert http_builder_problems(tmp_path) == [
        "completions.py calls SamplingParams(...) in ['route']",
        "sampling_kwargs is defined in ['responses.py', 'sampling.py'], not only in sampling.py",
        "completions.py does not call sampling_kwargs", "responses.py does not call sampling_kwargs"]


def test_the_builder_check_sees_a_second_builder(tmp_path):
    (tmp_path / "sampling.py").write_text("def sampling_params(body):\n    return SamplingParams(n=1)\n")
    (tmp_path / "chat.py").write_text("import x\n\nasync def route(b):\n    return x.SamplingParams(top_k=1)\n")
    (tmp_path / "other.py").write_text("from x import SamplingParams\nP = SamplingParams\n")
    assert sampling_params_builders(tmp_path) == {"chat.py": ["route"], "sampling.py": ["sampling_params"]}
