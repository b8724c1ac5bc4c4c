"""The HTTP server under faults a hostile or careless client causes (issue 18): idle and half-sent
connections, descriptor exhaustion, huge prompts, readers that stop reading, deeply nested and broken
bodies, disconnects during the body read, bad API-key settings, the concurrency limit and SIGTERM with
streams in flight.

After each fault the server must still answer a greedy request exactly as before, with every KV block
free and nothing running or waiting. Waits are bounded polls on engine or server signals, never timing
assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from helpers import wait_until
from llminfer.api import create_app, serve_in_thread
from llminfer.api.server import ServerLimits
from llminfer.config import EngineConfig
from llminfer.engine import InferenceEngine
from llminfer.logging import configure_logging, reset_logging

GREEDY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


def _greedy(url: str, headers: dict | None = None) -> str:
    r = httpx.post(url + "/v1/completions", json=GREEDY, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(url: str, name: str, headers: dict | None = None, labels: str = "") -> float:
    """Sum of the samples of ``name`` (``_total`` optional) whose label set contains the text ``labels``."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    pattern = rf"^{name}(?:_total)?{{([^}}]*)}} (\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if labels in m.group(1))


def _addr(url: str) -> tuple[str, int]:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _request_bytes(path: str, body: bytes, *, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# ---------------------------------------------------------------------------- in-thread server
@pytest.fixture(scope="module")
def served():
    """The built-in model behind a live server: two sequences at once, no queue beyond them, 1 s to
    send a request."""
    configure_logging("info")  # the request-log lines (info level) are asserted on; llminfer's default is warning
    engine = InferenceEngine(EngineConfig(max_batch_size=2)).load()
    app = create_app(engine, max_queue_size=0)
    limits = ServerLimits(read_timeout_s=1.0, keep_alive_timeout_s=1.0, shutdown_grace_s=1.0)
    server = serve_in_thread(app, limits=limits)
    with pytest.MonkeyPatch.context() as mp:
        # Small kernel send buffers on the listening socket (its connections inherit them; loopback would
        # otherwise buffer 4 MiB), so the writes to a client that stops reading block soon.
        mp.setattr(socket, "socket", _SmallSendBuffer)
        url = server.__enter__()
    try:
        yield url, engine, app.state["llminfer"], _greedy(url)
    finally:
        server.__exit__(None, None, None)
        reset_logging()


class _SmallSendBuffer(socket.socket):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.family in (socket.AF_INET, socket.AF_INET6):
            self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def _assert_healthy(served) -> None:
    url, engine, state, reference = served
    assert wait_until(lambda: engine.scheduler_stats() == {"running": 0, "waiting": 0}
                      and engine.cache_stats()["blocks_used"] == 0 and state.in_flight == 0, 60)
    assert _greedy(url) == reference
    assert wait_until(lambda: engine.cache_stats()["blocks_used"] == 0 and state.in_flight == 0, 60)


def test_half_sent_and_silent_connections_are_closed(served):
    url, *_ = served
    silent = socket.create_connection(_addr(url))
    partial_head = socket.create_connection(_addr(url))
    partial_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
    partial_body = socket.create_connection(_addr(url))
    partial_body.sendall(_request_bytes("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[:-10])
    for sock in (silent, partial_head, partial_body):
        sock.settimeout(60)  # a bound: the server's read timeout is 1 s
    assert _recv_all(silent) == b""
    head = _recv_all(partial_head)
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(head.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert _recv_all(partial_body) == b""  # the app saw a disconnect during the body read
    for sock in (silent, partial_head, partial_body):
        sock.close()
    _assert_healthy(served)


def test_disconnect_during_body_read_is_a_client_disconnect(served, capfd):
    url, *_ = served
    before = _metric(url, "llminfer_http_client_disconnects")
    sock = socket.create_connection(_addr(url))
    sock.sendall(_request_bytes("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')[:-5])
    time.sleep(0.2)  # let the server start reading the body (not asserted on)
    sock.close()
    assert wait_until(lambda: _metric(url, "llminfer_http_client_disconnects") == before + 1, 30)
    out = "".join(capfd.readouterr())
    line = next(ln for ln in out.splitlines() if "path=/v1/chat/completions" in ln and "disconnected=True" in ln)
    assert "status=499" in line and "status=500" not in out and "Traceback" not in out
    _assert_healthy(served)


BAD_BODIES = [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "hi", "logit_bias": ' + b'{"1": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b"[" * 200_000,
    b'{"a": ' * 100_000,
    b'{"prompt": "hi", "stop": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "temperature": 1e400}',
    b'{"prompt": "hi"',
    b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "\\ud800"}',
    b"\xef\xbb\xbf{}",
    b"null", b"[]", b'"text"', b"", b"{}", b"42",
]
CHAT_BAD = [
    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": ' + b"[" * 20_000 + b"]" * 20_000 + b"}]}",
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
    b'"json_schema": {"name": "x", "schema": ' + b'{"items": ' * 20_000 + b"{}" + b"}" * 20_000 + b"}}}",
]


def test_bad_bodies_are_400_without_a_traceback(served, capfd):
    url, *_ = served
    tried = 0
    with httpx.Client(timeout=60) as client:
        for path, bodies in (("/v1/completions", BAD_BODIES), ("/v1/chat/completions", BAD_BODIES + CHAT_BAD)):
            for body in bodies:
                r = client.post(url + path, content=body, headers={"content-type": "application/json"})
                tried += 1
                assert r.status_code == 400, (path, body[:60], r.status_code, r.text[:300])
                assert r.json()["error"]["type"] == "invalid_request_error"
    out = "".join(capfd.readouterr())
    assert "Traceback" not in out and "RecursionError" not in out and "status=500" not in out
    assert tried == 2 * len(BAD_BODIES) + len(CHAT_BAD)
    _assert_healthy(served)


def test_huge_prompts_are_refused_before_tokenizing_and_tokenized_off_the_loop(served, monkeypatch):
    url, engine, state, _ = served
    limit = state.max_prompt_chars
    assert limit == engine.max_model_len * max(map(len, engine.tokenizer.get_vocab()))
    encode = engine.tokenizer.encode
    seen: list[str] = []

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    big = "a" * (limit + 1)
    cases = [("/v1/completions", {"prompt": big}, "prompt"),
             ("/v1/completions", {"prompt": ["hi", big]}, "prompt[1]"),
             ("/v1/chat/completions", {"messages": [{"role": "system", "content": "a" * (limit // 2)},
                                                    {"role": "user", "content": "b" * (limit // 2 + 1)}]},
              "messages[1].content"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": big}]}]},
              "messages[0].content[0].text")]
    for path, body, param in cases:
        r = httpx.post(url + path, json={**body, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, "context_length_exceeded")
    assert seen == []  # refused without tokenizing
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hello " * 1000}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert seen and "llminfer-server" not in seen  # the server's event loop runs in that thread
    monkeypatch.undo()
    _assert_healthy(served)


def _stuck_stream(url: str, prompt: str) -> socket.socket:
    """A streamed completion whose client never reads (a small receive buffer, so the server's writes block)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(_addr(url))
    # About 1.5 kB a token (20 alternatives each): 150 tokens are more than the server's buffers hold.
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 150, "ignore_eos": True,
                       "stream": True, "temperature": 0, "logprobs": True, "top_logprobs": 20}).encode()
    sock.sendall(_request_bytes("/v1/chat/completions", body))
    return sock


@pytest.mark.slow
def test_reader_that_stops_reading_releases_its_admission(served):
    url, engine, state, _ = served
    def finished_as(reason: str) -> float:
        return _metric(url, "llminfer_request_success", labels=f'finished_reason="{reason}"')

    finished, aborted = finished_as("length"), finished_as("abort")
    socks = [_stuck_stream(url, f"story number {i}") for i in range(2)]  # the whole capacity (2 + queue 0)
    try:
        assert wait_until(lambda: finished_as("length") == finished + 2, 120)
        # Generation is over; the clients still have not read. A new client is admitted, not told 429.
        assert _greedy(url) == served[3]
        assert state.in_flight == 0
        assert not state.stoppers
    finally:
        for sock in socks:
            sock.close()
    assert wait_until(lambda: engine.scheduler_stats()["running"] == 0, 30)
    assert finished_as("abort") == aborted  # finished, not aborted
    _assert_healthy(served)


def test_draining_server_refuses_new_calls_with_503(served):
    url, _, state, _ = served
    state.begin_shutdown(1.0)
    try:
        r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(url + "/healthz", timeout=30).status_code == 503
    finally:
        state.draining = False
    _assert_healthy(served)


# ---------------------------------------------------------------------------- concurrency limit
def test_concurrency_limit_answers_an_openai_error():
    entered, release = threading.Event(), threading.Event()

    async def app(scope, receive, send):  # a bare ASGI app: the limit lives in the protocol
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        import anyio

        entered.set()
        while not release.is_set():
            await anyio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    with serve_in_thread(app, limits=ServerLimits(limit_concurrency=1, shutdown_grace_s=0)) as url:
        holder = threading.Thread(target=httpx.get, args=(url + "/hold",), kwargs={"timeout": 60})
        holder.start()
        try:
            assert entered.wait(30)
            r = httpx.get(url + "/probe", timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_requests"
        finally:
            release.set()
            holder.join(60)
        assert httpx.get(url + "/again", timeout=30).text == "ok"


def test_concurrency_limit_lets_exactly_the_limit_in_and_refuses_the_rest_cleanly():
    """Many clients at once, each with a body: exactly ``limit`` requests reach the app and every other one
    gets the 503 error object (its body read first: a 4 MB body still being sent when the server closed the
    connection would reset it), counted by the app's metrics."""
    limit, clients = 3, 24
    inside, release = [0], threading.Event()
    refused = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        import anyio

        while (await receive()).get("more_body"):
            pass
        inside[0] += 1
        while not release.is_set():
            await anyio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app.state = {"llminfer_metrics": SimpleNamespace(refused_busy=lambda: refused.append(1))}
    results: list = [None] * clients

    def post(i: int) -> None:
        try:
            results[i] = httpx.post(url + "/v1/completions", content=b"x" * 4_000_000, timeout=60)
        except httpx.HTTPError as exc:
            results[i] = exc

    with serve_in_thread(app, limits=ServerLimits(limit_concurrency=limit, shutdown_grace_s=0)) as url:
        threads = [threading.Thread(target=post, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        try:
            assert wait_until(lambda: sum(r is not None for r in results) == clients - limit, 60), results
            assert inside[0] == limit
            # the probes and the metrics scrape are outside the limit: they reach the app while it is full
            probe = threading.Thread(target=lambda: results.append(httpx.get(url + "/healthz", timeout=60)))
            probe.start()
            assert wait_until(lambda: inside[0] == limit + 1, 30)
        finally:
            release.set()
            for t in threads:
                t.join(60)
    probe.join(60)
    assert all(isinstance(r, httpx.Response) for r in results), [r for r in results if not isinstance(r, httpx.Response)]
    assert sorted(r.status_code for r in results) == [200] * (limit + 1) + [503] * (clients - limit)
    assert all(r.json()["error"]["code"] == "too_many_requests" for r in results if r.status_code == 503)
    assert len(refused) == clients - limit


# ---------------------------------------------------------------------------- API-key settings
def _serve_cli(args: list[str], capsys) -> tuple[int, str]:
    from llminfer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "0", *args])
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--api-key", ""], None, "empty or blank"),
    (["--api-key", "   "], None, "empty or blank"),
    (["--api-key", " k "], None, "whitespace"),
    ([], "", "LLMINFER_API_KEY"),
    ([], " \t", "LLMINFER_API_KEY"),
    (["--api-key-file", "EMPTY"], None, "--api-key-file"),
    (["--api-key-file", "MISSING"], None, "cannot read"),
    (["--api-key", "k", "--api-key-file", "KEY"], None, "not both"),
])
def test_bad_api_key_settings_are_refused_at_start(args, env, words, tmp_path, monkeypatch, capsys):
    (tmp_path / "EMPTY").write_text("\n")
    (tmp_path / "KEY").write_text("k\n")
    args = [str(tmp_path / a) if a in ("EMPTY", "MISSING", "KEY") else a for a in args]
    monkeypatch.delenv("LLMINFER_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("LLMINFER_API_KEY", env)
    code, err = _serve_cli(args, capsys)
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1 and words in err, err


# ---------------------------------------------------------------------------- subprocess server
OPEN_FILES = 64  #: the server process's descriptor limit (it needs about 10 at rest)
GRACE_S = 2.0


@pytest.fixture(scope="module")
def subprocess_server(tmp_path_factory):
    """``llminfer serve`` (key from a file) with 64 descriptors, 1 s read and keep-alive timeouts, a 2 s
    shutdown grace period and room for 24 sequences at once."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "key").write_text("s3cret\n")
    headers = {"Authorization": "Bearer s3cret"}
    args = ["--api-key-file", str(tmp / "key"), "--max-batch-size", "24", "--max-queue-size", "0",
            "--read-timeout-s", "1", "--keep-alive-timeout-s", "1", "--shutdown-grace-s", str(GRACE_S),
            "--batch-timeout-ms", "1"]
    with _serve_subprocess(tmp / "server.log", args, open_files=OPEN_FILES) as (proc, url):
        assert f"at {url}/v1 (Ctrl-C stops)" in (tmp / "server.log").read_text()  # it says where it serves
        yield proc, url, headers, tmp / "server.log", _greedy(url, headers)


@contextlib.contextmanager
def _serve_subprocess(log_path, args: list[str], open_files: int | None = None):
    """``llminfer serve`` with ``args`` (info logs to ``log_path``) in a subprocess, once it has printed its
    "serving ... at URL" line: ``(process, base URL)``. Killed on the way out if still running. The line is
    a promise that the server accepts connections: ``/healthz`` must answer 200 at once, with no retry."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from llminfer.cli import main; main()", "serve", "--port", str(port), *args,
           "--log-level", "info"]
    limit = None if open_files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files)))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=limit)
    url = f"http://127.0.0.1:{port}"
    try:
        def announced() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return "(Ctrl-C stops)" in log_path.read_text()

        assert wait_until(announced, 180), log_path.read_text()
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _assert_subprocess_healthy(url, headers, reference) -> None:
    assert _greedy(url, headers) == reference
    for name in ("llminfer_kv_blocks_used", "llminfer_num_requests_running", "llminfer_num_requests_waiting"):
        assert wait_until(lambda n=name: _metric(url, n, headers) == 0, 30), name


@pytest.mark.slow
def test_idle_sockets_beyond_the_descriptor_limit_do_not_lock_clients_out(subprocess_server):
    proc, url, headers, log_path, reference = subprocess_server
    idle = []
    try:
        for _ in range(OPEN_FILES + 16):  # more than the server can hold open; the rest wait in the backlog
            idle.append(socket.create_connection(_addr(url)))
        # The idle connections are closed after the 1 s read timeout, so this client is served (bound: 120 s).
        r = httpx.post(url + "/v1/completions", json=GREEDY, headers=headers, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401  # the key from the file is required
    _assert_subprocess_healthy(url, headers, reference)
    out = log_path.read_text()
    assert "Traceback" not in out and out.count("cannot accept connections") < 10


def _stream(url: str, headers: dict, i: int, started: threading.Event, results: list) -> None:
    frames: list = []
    try:
        body = {"prompt": f"Tell story number {i}", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    frames.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        frames.append(exc)
    finally:
        started.set()
        results[i] = frames


@pytest.mark.slow
def test_sigterm_with_streams_in_flight_ends_every_stream_with_done(subprocess_server):
    proc, url, headers, log_path, _ = subprocess_server
    n = 20
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(url, headers, i, started[i], results)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(GRACE_S + 2)
    waited = time.monotonic() - t0
    # Every client has its answer within the grace period (a bound, + 2 s, not a speed measurement). The
    # process exits after that, once the interpreter has torn down (seconds with torch and transformers
    # loaded, and longer on a busy machine: not llminfer's to bound).
    assert waited <= GRACE_S + 2 and not any(t.is_alive() for t in threads)
    proc.wait(timeout=60)
    # uvicorn re-raises the signal once it has shut down; serve catches it, closes its engine and exits 0
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    finished = ended = 0
    for frames in results:
        assert frames and frames[-1] == "[DONE]", frames[-3:]
        last = frames[-2]
        assert not isinstance(last, Exception), last
        if "error" in last:
            assert last["error"]["code"] == "aborted" and last["error"]["type"] == "server_error"
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert finished + ended == n
    out = log_path.read_text()
    assert len(re.findall(r"\] shutting down\s", out)) == 1
    assert "Traceback" not in out and "stream failed" not in out
    # every stream had its first token before the signal: each log line counts what its stream generated (an
    # aborted one logged completion_tokens=0)
    counts = [int(c) for c in re.findall(r"completion_tokens=(\d+)", out)]
    assert len(counts) >= n and min(counts) > 0, counts


def test_accept_retry_after_shutdown_is_not_a_traceback():
    """asyncio retries accept() a second after running out of descriptors; when shutdown closed the socket
    meanwhile the retry raises ValueError('Invalid file descriptor: -1'): dropped, while anything else still
    reaches the loop's default handler."""
    from llminfer.api import server

    seen = []

    class Loop:
        def default_exception_handler(self, context):
            seen.append(context)

    retry = {"message": "Exception in callback", "exception": ValueError("Invalid file descriptor: -1"),
             "handle": "<TimerHandle when=1.0 BaseSelectorEventLoop._start_serving(...)>"}
    server._loop_exception(Loop(), retry)
    assert seen == []
    other = {"message": "Exception in callback", "exception": ValueError("boom"), "handle": "<Handle f()>"}
    server._loop_exception(Loop(), other)
    assert seen == [other]


@pytest.mark.slow
def test_a_second_ctrl_c_ends_every_stream_with_done_and_exits_130(tmp_path):
    """A forced quit (Ctrl-C during the graceful shutdown) used to cut the streams mid-chunk, log
    ``CancelledError`` tracebacks and exit 0. Now the streams still running get an error event and
    ``[DONE]``, the command says so in one line and exits 130."""
    log_path = tmp_path / "server.log"
    with _serve_subprocess(log_path, ["--shutdown-grace-s", "120"]) as (proc, url):
        n = 4
        results: list = [None] * n
        started = [threading.Event() for _ in range(n)]
        threads = [threading.Thread(target=_stream, args=(url, {}, i, started[i], results)) for i in range(n)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in started)
        proc.send_signal(signal.SIGINT)
        # the first Ctrl-C starts the graceful shutdown (120 s of grace): the streams go on
        assert wait_until(lambda: re.search(r"\] shutting down\s", log_path.read_text()) is not None, 60)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for t in threads:
            t.join(60)
    out = log_path.read_text()
    assert proc.returncode == 130, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("error: forced shutdown"), out[-1000:]
    for frames in results:
        assert frames and frames[-1] == "[DONE]", frames[-3:]
        assert frames[-2]["error"]["code"] == "aborted", frames[-2]
    assert "Traceback" not in out, out[-3000:]


def test_run_server_shortens_the_gil_switch_interval_while_it_serves(monkeypatch):
    """The model thread gets the GIL back within SERVER_SWITCH_INTERVAL_S of the event loop's Python, and the
    interpreter's own interval is restored afterwards."""
    from llminfer.api import server as server_module

    seen = []

    class Recorder:
        force_exit = False

        def __init__(self, *_args, **_kwargs):
            pass

        def run(self, sockets=None):
            seen.append(sys.getswitchinterval())

    monkeypatch.setattr(server_module, "_Server", Recorder)
    monkeypatch.setattr(server_module, "uvicorn_config", lambda *a, **k: None)
    before = sys.getswitchinterval()
    assert server_module.run_server(object()) is False
    assert seen == [pytest.approx(min(before, server_module.SERVER_SWITCH_INTERVAL_S))]
    assert seen[0] < 0.005 and sys.getswitchinterval() == before
    monkeypatch.setattr(server_module, "uvicorn_config", lambda *a, **k: 1 / 0)  # fails before serving
    with pytest.raises(ZeroDivisionError):
        server_module.run_server(object())
    assert sys.getswitchinterval() == before
