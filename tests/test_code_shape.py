"""The code's shape, held: the scheduler's planning function stays short enough to read in one screen,
and the import-cycle tool works (``tools/import_cycles.py``)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

from llminfer.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]


def _function_lines(func) -> int:
    node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    return node.end_lineno - node.lineno + 1


def test_schedule_is_at_most_60_lines():
    assert _function_lines(Scheduler.schedule) <= 60


def _load_tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_cycles"] = module
    spec.loader.exec_module(module)
    return module


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
