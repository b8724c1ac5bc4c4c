"""bench/run_all.py (what ``nox -s bench`` runs) without running a benchmark: every registered suite
understands ``--quick``, ``--quick`` switches a suite's defaults and explicit flags still win, the ratio
table reads what the suites wrote, and the noxfile runs in the project's own interpreter as it says."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_all():
    return _load("run_all")


def test_every_suite_exists_and_understands_quick(run_all):
    assert len({s.name for s in run_all.SUITES}) == len(run_all.SUITES)
    for suite in run_all.SUITES:
        text = (BENCH / suite.script).read_text()
        assert "--quick" in suite.quick_args, suite
        # Either common.parse_args (which adds --quick) or a --quick flag of its own.
        assert re.search(r"parse_args\(ap, \{", text) or '"--quick"' in text, suite.script
    files = {r.file for r in run_all.RATIOS}
    written = " ".join((BENCH / s.script).read_text() for s in run_all.SUITES)
    for file in files:  # each table row reads a file some suite saves
        stem = Path(file).stem  # saved by name, or under the payload's own "benchmark" name
        assert (f"save(\"{stem}\"" in written or f"save('{stem}'" in written
                or f'"benchmark": "{stem}"' in written), file


def test_quick_switches_defaults_and_explicit_flags_win():
    common = _load("common")

    def parser():
        ap = argparse.ArgumentParser()
        ap.add_argument("--reps", type=int, default=3)
        ap.add_argument("--batch", type=int, default=32)
        return ap

    quick = {"reps": 1, "batch": 8}
    assert vars(common.parse_args(parser(), quick, [])) == {"reps": 3, "batch": 32, "quick": False}
    assert vars(common.parse_args(parser(), quick, ["--quick"])) == {"reps": 1, "batch": 8, "quick": True}
    assert vars(common.parse_args(parser(), quick, ["--batch", "4", "--quick"])) == {"reps": 1, "batch": 4,
                                                                                     "quick": True}


def test_ratio_table_reads_the_results(run_all, tmp_path):
    results = {"batch_1": {"speed_ratio_compiled_over_eager": 1.25},
               "batch_4": {"speed_ratio_compiled_over_eager": 0.5}}  # --quick: no batch 32
    (tmp_path / "compiled_vs_eager.json").write_text(json.dumps({"results": results}))
    (tmp_path / "tracing.json").write_text("{not json")
    rows = {line[:52].strip(): line[52:].split() for line in run_all.summary_table(tmp_path).splitlines()[1:]}
    assert rows["compiled / eager tokens/s, batch 1 (CPU)"] == ["1.250", "report"]
    assert rows["compiled / eager tokens/s, largest batch (CPU)"] == ["0.500", "report"]
    assert rows["compiled / eager tokens/s, slowest batch (CPU)"] == ["0.500", ">=", "0.95", "(checked)"]
    assert rows["tracing on / off throughput"] == ["-", ">=", "0.98"]
    assert len(rows) == len(run_all.RATIOS)


def test_compiled_slower_than_eager_by_more_than_5_percent_fails_the_run(run_all, tmp_path):
    assert run_all.failed_checks(tmp_path) == []  # nothing measured: nothing fails here
    results = {"batch_1": {"speed_ratio_compiled_over_eager": 1.3}, "batch_8": {"speed_ratio_compiled_over_eager": 0.96},
               "batch_32": {"speed_ratio_compiled_over_eager": 0.94}}
    (tmp_path / "compiled_vs_eager.json").write_text(json.dumps({"results": results}))
    (failed,) = run_all.failed_checks(tmp_path)
    assert "batch 32 is 0.940 < 0.95" in failed
    results["batch_32"]["speed_ratio_compiled_over_eager"] = 0.951
    (tmp_path / "compiled_vs_eager.json").write_text(json.dumps({"results": results}))
    assert run_all.failed_checks(tmp_path) == []


def test_list_and_unknown_suite(run_all, capsys):
    assert run_all.main(["--list", "--quick", "--only", "tracing,serving"]) == 0
    assert capsys.readouterr().out.splitlines() == ["tracing        python bench/bench_tracing.py --quick",
                                                    "serving        python bench/bench_serving.py --quick"]
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--only", "nope"])
    assert exc.value.code == 2 and "unknown suite(s) nope" in capsys.readouterr().err


def test_noxfile_builds_a_venv_only_for_vllm():
    """The project's own sessions run in the project's environment; only ``vllm`` builds one (vLLM pins its
    own transformers), and it installs only there."""
    text = (BENCH.parent / "noxfile.py").read_text()
    sessions = dict((name, args) for args, name in re.findall(r"@nox\.session\((.*?)\)\ndef (\w+)", text))
    assert set(sessions) == {"tests", "lint", "bench", "vllm"}
    assert all(sessions[name] == 'venv_backend="none"' for name in ("tests", "lint", "bench"))
    assert sessions["vllm"].startswith('venv_backend="venv"')
    installs_before_vllm = text[: text.index("def vllm(")].count("session.install")
    assert installs_before_vllm == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_suites_report_exit_codes_and_a_timeout_stops_their_children(run_all, tmp_path, capfd):
    import subprocess

    def script(name: str, body: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(body)
        return path

    ok = script("ok", "import sys\nLEAKED = 1\nprint('args', sys.argv[1:])\n")
    assert run_all.run_forked(ok, ["--quick"], None) == 0
    assert "args ['--quick']" in capfd.readouterr().out
    assert "LEAKED" not in globals() and not hasattr(run_all, "LEAKED")  # the suite ran in its own process
    assert run_all.run_forked(script("code", "import sys\nsys.exit(3)\n"), [], None) == 3
    assert run_all.run_forked(script("boom", "raise ValueError('suite bug')\n"), [], None) == 1
    assert "ValueError: suite bug" in capfd.readouterr().err

    pid_file = tmp_path / "grandchild.pid"
    hang = script("hang", "import subprocess, sys, time\n"
                          f"p = subprocess.Popen(['sleep', '600'])\nopen({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                          "time.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_all.run_forked(hang, [], 3.0)
    grandchild = int(pid_file.read_text())
    try:
        state = Path(f"/proc/{grandchild}/status").read_text()
    except FileNotFoundError:
        state = "State: gone"
    assert "State:\tZ" in state or state == "State: gone", state  # killed with its suite (a zombie at most)
