"""What a new user met: ``llminfer chat``, Ctrl-C that stops generation within a step, ``serve`` on a port in
use, a mistyped model name, the README's sampling example, and the command line's default model."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.cli import chat, generate, info, main, serve
from llminfer.errors import ModelLoadError
from llminfer.models import loading
from llminfer.sampling.params import SamplingParams

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def engine(qwen2_dir):  # a random-weight Qwen2 with the real Qwen2 tokenizer and its ChatML template
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu", dtype="float32",
                                      max_batch_size=4)).load() as e:
        yield e


def test_chat_loop_is_multi_turn_through_the_template(engine, capsys):
    kw = dict(max_new_tokens=5, ignore_eos=True)
    lines = iter(["Hello", "", "/reset", "Hi", "And then?", "/exit", "never read"])
    messages = chat.chat_loop(engine, SamplingParams(**kw), system="Be brief.", read_line=lambda: next(lines))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    first = engine.chat(messages[:2], **kw).text
    second = engine.chat(messages[:4], **kw).text
    assert messages[2]["content"] == first and messages[4]["content"] == second
    out = capsys.readouterr()
    hello = engine.chat([messages[0], {"role": "user", "content": "Hello"}], **kw).text
    assert out.out == f"{hello}\n{first}\n{second}\n" and "(conversation cleared)" in out.err


def test_chat_loop_drops_a_turn_that_fails_and_goes_on(engine, capsys):
    lines = iter(["x" * 40, "Hello"])

    def read_line():
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    messages = chat.chat_loop(engine, SamplingParams(max_new_tokens=engine.max_model_len), read_line=read_line)
    assert [m["content"] for m in messages if m["role"] == "user"] == []  # both too long for the context
    assert capsys.readouterr().err.count("error:") == 2


def test_chat_command_reads_lines_from_a_pipe_and_ends_at_eof():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # LLMINFER_DEFAULT_MODEL: the tiny model (conftest)
    p = subprocess.run([sys.executable, "-m", "llminfer", "chat", "-n", "3"], input="Hello\nAgain\n", text=True,
                       capture_output=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == 2 and p.stderr == ""


class _Steps:
    """A stat logger counting engine steps; interrupts the main thread (as Ctrl-C does) at step ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.count = at, 0

    def record(self, stats) -> None:
        self.count += 1
        if self.count == self.at:  # a real SIGINT, sent to another thread than the main one, as a terminal may
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)


@pytest.mark.parametrize("how", ["stream", "run"])
def test_ctrl_c_stops_generation_within_a_step(engine, how):
    steps = _Steps(at=3)
    engine.stat_loggers.append(steps)
    try:
        with pytest.raises(KeyboardInterrupt):
            if how == "stream":
                for _ in engine.stream("Hello", max_new_tokens=1500, ignore_eos=True):
                    pass
            else:
                engine.run("Hello", max_new_tokens=1500, ignore_eos=True)
        engine.wait_drained()  # without the abort: after all 1500 tokens
    finally:
        engine.stat_loggers.remove(steps)
    # The interrupted thread notices within one poll of its wait (0.1 s): a bound far below the 1500 steps the
    # request runs without the abort, and far above what a poll's worth of tiny-model steps can be.
    assert steps.count < 300, steps.count
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks or engine.is_idle()


def test_serve_on_a_port_in_use_fails_before_loading(monkeypatch, capsys):
    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(serve, "load_engine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--port", str(port)])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and f"cannot listen on 127.0.0.1:{port}" in err[0], err


def test_a_mistyped_model_name_fails_at_once(monkeypatch):
    cfg = EngineConfig()
    with pytest.raises(ModelLoadError, match="no local folder of that name, and it is not a Hugging Face"):
        loading.check_hub_id("my/models/smollm2", cfg)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    monkeypatch.setattr(loading, "_in_hf_cache", lambda *a: False)
    with pytest.raises(ModelLoadError, match="no local folder 'models-smollm2', the Hugging Face hub cannot be "
                                             "reached"):
        loading.load_config("models-smollm2", cfg)
    monkeypatch.setattr(loading, "_in_hf_cache", lambda *a: True)  # cached: transformers takes it from there
    loading.check_hub_id("org/cached-model", cfg)


def test_the_command_lines_default_model(monkeypatch, capsys):
    seen = []

    def capture(cfg, *_a, **_k):
        seen.append(cfg.model_name)
        raise KeyboardInterrupt

    for module in (generate, chat, info):
        monkeypatch.setattr(module, "load_engine", capture)
    monkeypatch.delenv("LLMINFER_DEFAULT_MODEL")
    for argv in (["run", "x"], ["stream", "x"], ["info"], ["chat"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert seen == ["llminfer/smollm2-135m-instruct"] * 4


def test_readme_sampling_example_prints_text():
    """The README's first sampling example, run as written (on the tiny model: LLMINFER_DEFAULT_MODEL), prints
    text: its --stop strings do not end the output at the first token."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("llminfer run") and "--stop" in ln)
    argv = shlex.split(line, comments=True)
    assert argv[0] == "llminfer"
    p = subprocess.run([sys.executable, "-m", "llminfer", *argv[1:]], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    text, stats = p.stdout.rsplit("\n", 2)[:2]
    assert re.search(r"completion (\d+) tok", stats) and int(re.search(r"completion (\d+) tok", stats)[1]) > 4
    assert text.strip(), p.stdout

