"""The command line answers at once and checks every flag before loading; ``run`` / ``stream`` apply the
chat template; the Python API is quiet (logs on stderr at warning, no transformers bars)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import structlog

from llminfer import EngineConfig, InferenceEngine
from llminfer.cli import chat, generate, info, main, resolve_aliases, serve
from llminfer.cli.sampling import SamplingOptions, sampling_options
from llminfer.logging import configure_logging, reset_logging, status

HEAVY = ("torch", "transformers", "polars", "matplotlib", "litestar", "xgrammar")

# Runs in a fresh interpreter: --help of the app and of every command, flag errors, sampling errors.
_PROBE = """
import json, sys
from llminfer.cli import main
calls = [["--help"], ["--version"], *[[c, "--help"] for c in ("run", "stream", "info", "serve", "bench", "compare",
         "bench-serve")], ["run", "x", "--temp", "-1"], ["run", "x", "--bogus"], ["serve", "--page-size", "0"],
         ["run", "x", "--top-p", "2"], ["stream", "x", "--system", "s", "--no-chat"]]
codes = []
for argv in calls:
    print("@@", " ".join(argv), flush=True)
    try:
        main(argv)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "heavy": [m for m in HEAVY if m in sys.modules]}), file=sys.__stderr__)
"""


def test_help_and_flag_errors_import_no_heavy_library():
    p = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{_PROBE}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    report = json.loads(p.stderr.strip().splitlines()[-1])
    assert report["heavy"] == [], report
    assert report["codes"][:9] == [0] * 9 and all(c not in (0, None) for c in report["codes"][9:]), report
    helps = dict(part.split("\n", 1) for part in p.stdout.split("@@ ")[1:])
    assert helps["--version"].strip() == f"llminfer {version('llminfer')}"
    assert "--version" in helps["--help"]
    run = helps["run --help"]
    assert "--num-samples" in run and "--chat / --no-chat" in run and "--system" in run and "--attention-backend" in run
    assert "--n " not in run and "--page-size-tokens" not in run + helps["serve --help"]  # hidden old spellings


def _no_load(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the flags were checked")


@pytest.mark.parametrize("argv, needle", [
    (["run", "x", "--temp", "-1"], "--temp: temperature"),
    (["run", "x", "--top-p", "0"], "--top-p: top_p"),
    (["run", "x", "--top-k", "-2"], "--top-k: top_k"),
    (["run", "x", "--num-samples", "0"], "--num-samples: n must"),
    (["run", "x", "--n", "0"], "--num-samples: n must"),  # the old spelling still works
    (["run", "x", "-n", "0"], "--max-new-tokens: max_new_tokens"),
    (["stream", "x", "--min-p", "2"], "--min-p"),
    (["stream", "x", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["run", "x", "--dtype", "int3"], "dtype"),
    (["run", "x", "--device", "gpu"], "--device"),
    (["info", "--backend", "tpu"], "tpu"),
    (["serve", "--attention-backend", "flash"], "attention_backend"),
    (["info", "--page-size-tokens", "0"], "page_size_tokens"),
    (["run", "x", "--model", "./no/such/folder"], "does not exist"),
    (["run", "x", "--adapter-name", "a"], "--adapter-name needs --adapter"),
    (["serve", "--adapter", "/no/such/adapter"], "--adapter: '/no/such/adapter' is not a folder"),
    (["run", "x", "--system", "be brief", "--no-chat"], "--system needs the chat template"),
    (["run", "x", "--json-schema", "@/no/such.json"], "cannot read"),
    (["run", "x", "--log-level", "loud"], "--log-level"),
    (["bench-serve", "--log-level", "loud"], "--log-level"),
    (["bench-report", "x.json", "--log-level", "loud"], "--log-level"),
    (["run", "x", "--dtype", "float64"], "--dtype: dtype must be one of"),
    (["bench", "--runs", "0"], "--runs: runs must be >= 1"),
    (["serve", "--threads", "0"], "--threads"),
    (["compare", "--threads", "-1"], "--threads"),
    (["chat", "--threads", "0"], "Invalid value for '--threads'"),  # chat takes it too (checked, not unknown)
    (["serve", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["bench", "--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold"),
    (["run", ""], "empty"),
])
def test_every_flag_is_checked_before_the_model_loads(argv, needle, monkeypatch, capsys):
    for module in (generate, chat, info, serve):
        monkeypatch.setattr(module, "load_engine", _no_load)
    monkeypatch.setattr(InferenceEngine, "load", _no_load)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code not in (0, None) and len(err) == 1 and err[0].startswith("error:"), err
    assert needle in err[0], err


def test_scheduler_flags_reach_the_engine_config():
    from llminfer.cli.engine_options import EngineOptions

    cfg = EngineOptions(max_num_batched_tokens=512, long_prefill_token_threshold=128).to_config(check=False)
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.long_prefill_token_threshold) == (512, 128)
    assert EngineOptions().to_config(check=False).scheduler == EngineConfig().scheduler  # unset: the defaults


def test_old_flag_spellings_map_to_the_new_names():
    assert resolve_aliases(["run", "p", "--n", "3", "--n=2", "--page-size-tokens", "8", "--", "--n"]) == [
        "run", "p", "--num-samples", "3", "--num-samples=2", "--page-size", "8", "--", "--n"]
    assert resolve_aliases(["bench-serve", "--n", "1"]) == ["bench-serve", "--n", "1"]  # not a flag there


@pytest.fixture(scope="module")
def engine(qwen2_dir):  # a random-weight Qwen2 with the real Qwen2 tokenizer and its ChatML template
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu", dtype="float32")).load() as e:
        yield e


def _cli(engine, monkeypatch, capsys, *argv: str) -> tuple[str, str]:
    @contextlib.contextmanager
    def lend(*_args, **_kwargs):
        yield engine

    monkeypatch.setattr(generate, "load_engine", lend)
    capsys.readouterr()
    main(list(argv))
    text, stats = capsys.readouterr().out.rsplit("\n", 2)[:2]
    return text, stats


def test_run_and_stream_apply_the_chat_template_by_default(engine, monkeypatch, capsys):
    kw = dict(max_new_tokens=6, ignore_eos=True)
    system = [{"role": "system", "content": "Answer in one word."}]
    user = [{"role": "user", "content": "Hello"}]
    text, stats = _cli(engine, monkeypatch, capsys, "run", "Hello", "-n", "6", "--ignore-eos")
    assert text == engine.chat(user, **kw).text and "chat template: on" in stats
    text, stats = _cli(engine, monkeypatch, capsys, "stream", "Hello", "-n", "6", "--ignore-eos",
                       "--system", "Answer in one word.")
    assert text == engine.chat(system + user, **kw).text and "chat template: on" in stats
    text, stats = _cli(engine, monkeypatch, capsys, "run", "Hello", "-n", "6", "--ignore-eos", "--no-chat")
    assert text == engine.run("Hello", **kw).generated_text and "chat template: off" in stats
    assert engine.run("Hello", **kw).generated_text != engine.chat(user, **kw).text  # the test can fail


def test_chat_flags_on_a_model_without_a_template(engine, monkeypatch, capsys):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    text, stats = _cli(engine, monkeypatch, capsys, "run", "Hello", "-n", "3", "--ignore-eos")
    assert text == engine.run("Hello", max_new_tokens=3, ignore_eos=True).generated_text
    assert "chat template: off" in stats
    for flags in (["--chat"], ["--system", "s"]):
        with pytest.raises(SystemExit):
            _cli(engine, monkeypatch, capsys, "run", "Hello", *flags)
        assert "no chat template" in capsys.readouterr().err


def test_the_library_logs_to_stderr_at_warning_and_draws_no_bars(qwen2_dir, capfd, monkeypatch):
    monkeypatch.delenv("LLMINFER_LOG_LEVEL", raising=False)
    reset_logging()
    capfd.readouterr()
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu")).load() as engine:
        engine.run("Hello", max_new_tokens=2)
    log = structlog.get_logger("llminfer.test")
    log.info("an info line")
    log.warning("a warning line")
    out, err = capfd.readouterr()
    assert out == ""
    assert "a warning line" in err and "an info line" not in err
    assert "%|" not in err and "Loading" not in err  # no transformers progress bar
    monkeypatch.setenv("LLMINFER_LOG_LEVEL", "INFO")
    try:
        reset_logging()
        log.info("now shown")
        assert "now shown" in capfd.readouterr().err
        configure_logging("error")
        log.warning("hidden")
        assert capfd.readouterr() == ("", "")
        with pytest.raises(ValueError, match="log level"):
            configure_logging("loud")
    finally:
        monkeypatch.delenv("LLMINFER_LOG_LEVEL")
        reset_logging()


def test_status_lines_are_logged_and_drawn_only_when_enabled(capfd):
    from llminfer.logging import enable_status_lines

    configure_logging("debug")
    try:
        with structlog.testing.capture_logs() as logs, status("loading x ..."):
            pass
        assert [e["event"] for e in logs] == ["loading x ..."]
        assert capfd.readouterr().err == ""  # status lines are off unless enabled (the CLI, on a terminal)
        enable_status_lines(True)
        with status("outer"), status("inner"):  # one line at a time: the inner one is only logged
            pass
    finally:
        enable_status_lines(False)
        reset_logging()


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "load_engine", interrupted)
    with pytest.raises(SystemExit) as exc:
        main(["run", "hello"])
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["error: interrupted"]


def test_sampling_flags_are_parsed_once_into_sampling_params(tmp_path):
    """Every :class:`SamplingOptions` field named like a ``SamplingParams`` field reaches it unchanged (so a
    new sampling control needs one declared field), comma lists are split, the structured-output flags make
    one constraint, and a bad value names its flag."""
    import attrs
    import typer

    from llminfer.cli.sampling import option_flag, request_kwargs
    from llminfer.sampling.params import SamplingParams

    shared = sorted(set(attrs.fields_dict(SamplingOptions)) & set(attrs.fields_dict(SamplingParams)))
    assert {"temperature", "top_p", "seed", "n", "logprobs", "stop_sequences"} <= set(shared)
    odd = dict(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=11, ignore_eos=True,
               repetition_penalty=1.2, no_repeat_ngram_size=2, logprobs=2, n=3)
    params = SamplingOptions(**odd, stop_sequences=r"a,\n", bad_words="x,,y", force_words="z").to_params()
    assert {k: getattr(params, k) for k in odd} == odd
    assert (params.stop_sequences, params.bad_words, params.force_words) == (("a", "\n"), ("x", "y"), ("z",))
    assert SamplingOptions().to_params() == SamplingParams(max_new_tokens=64)  # the flags' defaults are the params'
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    constraint = SamplingOptions(json_schema=f"@{schema}").to_params().structured_output
    assert json.loads(constraint.json_schema) == {"type": "object"}
    assert list(SamplingOptions(choice=["yes", "no"]).to_params().structured_output.choice) == ["yes", "no"]
    for options, flag in ((SamplingOptions(temperature=-1), "--temp"), (SamplingOptions(n=0), "--num-samples"),
                          (SamplingOptions(json_object=True, ignore_eos=True), "--ignore-eos")):
        with pytest.raises(typer.BadParameter, match=f"^{flag}: "):
            options.to_params()
    assert option_flag("stop_sequences") == "--stop" and option_flag("min_new_tokens") == "--min-new-tokens"
    assert "n" not in request_kwargs(params) and request_kwargs(params)["top_k"] == 3


def test_a_command_gets_the_sampling_flags_it_offers():
    import typer
    from typer.testing import CliRunner

    seen = []
    app = typer.Typer()

    @app.command()
    @sampling_options(exclude=("n", "logprobs"), max_new_tokens=9)
    def cmd(word: str, sampling: SamplingOptions = SamplingOptions(), loud: bool = False) -> None:
        seen.append((word, sampling, loud))

    runner = CliRunner()
    assert runner.invoke(app, ["w", "--temp", "0.5", "--stop", "a,b", "--loud"]).exit_code == 0
    assert seen == [("w", SamplingOptions(max_new_tokens=9, temperature=0.5, stop_sequences=("a", "b")), True)]
    help_text = runner.invoke(app, ["--help"]).output
    assert "--top-p" in help_text and "--num-samples" not in help_text and "--logprobs" not in help_text
    assert runner.invoke(app, ["w", "--num-samples", "2"]).exit_code == 2  # excluded: no such flag here
    with pytest.raises(TypeError):
        sampling_options(exclude=("no_such_field",))
