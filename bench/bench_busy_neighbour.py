"""Batch-1 decode and serving with and without a busy neighbour: another process keeping one core busy.

The neighbour is a bounded spin loop in its own process (``while time < deadline: pass``, at most
``--neighbour-max-s`` seconds, ended as soon as its phase is over). Everything is interleaved in one run, so a
machine whose load drifts affects every setting alike:

* ``decode``: one engine (``--dtype``, ``--quant``) whose thread count is switched between ``--threads-list``
  settings (``auto`` = the default, :mod:`llminfer.core.threads`; a number = fixed). For ``--rounds`` rounds,
  for neighbour off and on, for each setting: one warm-up run of ``--warm-tokens`` (the auto setting measures
  the idle cores every 0.5 s, so it sees the neighbour before the measured runs), then the median ms/token
  of ``--runs`` runs of ``--tokens`` tokens.
* ``serve`` (unless ``--no-serve``): ``llminfer serve`` with the default threads in its own process; the mixed
  workload (prompts of 16-64 words, 16-64 tokens out, ``--concurrency`` clients) quiet, with the neighbour,
  quiet again; the ratio of the neighbour's output tok/s over the mean quiet one.

``/proc/loadavg`` is recorded before and after. Targets (issue 35): with the neighbour, auto no slower than
1 thread, and serving at least 45 % of its quiet throughput.

    python bench/bench_busy_neighbour.py [--rounds 2] [--dtype float32] [--quant none] [--no-serve]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import BENCH_VOCAB, bench_model_path, environment, parse_args, random_prompts, save

_SPIN = "import sys, time\nd = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < d:\n    pass\n"


@contextlib.contextmanager
def neighbour(on: bool, max_s: float):
    """A process spinning on one core for at most ``max_s`` seconds while the block runs (nothing if off)."""
    if not on:
        yield
        return
    # Not a child of this process: llminfer counts its descendants' CPU time as its own work (compile
    # workers), so a spinner started with Popen would be invisible to the auto thread count. The shell
    # starts it in the background and exits; the spinner then belongs to init, as another program would.
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" "$1" >/dev/null 2>&1 & echo $!', _SPIN,
                            str(max_s)], capture_output=True, text=True, check=True)
    pid = int(shell.stdout.strip())
    try:
        time.sleep(0.2)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def decode_phase(args: argparse.Namespace) -> dict[str, Any]:
    from llminfer import EngineConfig, InferenceEngine
    from llminfer.config import QuantConfig, QuantMode
    from llminfer.core.threads import ThreadGovernor

    cfg = EngineConfig(model_name=str(bench_model_path()), dtype=args.dtype, device="cpu", max_batch_size=1,
                       batch_timeout_ms=0, quant=QuantConfig(mode=QuantMode(args.quant)))
    settings = args.threads_list.split(",")
    out: dict[str, dict[str, list[float]]] = {n: {s: [] for s in settings} for n in ("quiet", "neighbour")}
    chosen: dict[str, dict[str, list[int]]] = {n: {s: [] for s in settings} for n in ("quiet", "neighbour")}
    with InferenceEngine(cfg) as engine:
        prompt = random_prompts(1, 8, BENCH_VOCAB, seed=1)[0]
        engine.run(prompt, max_new_tokens=4, ignore_eos=True)
        for _ in range(args.rounds):
            for phase in ("quiet", "neighbour"):
                with neighbour(phase == "neighbour", args.neighbour_max_s):
                    for setting in settings:
                        gov = ThreadGovernor(None if setting == "auto" else int(setting))
                        engine.threads = engine.model_thread.threads = gov
                        engine.run(prompt, max_new_tokens=args.warm_tokens, ignore_eos=True)
                        runs = []
                        for _ in range(args.runs):
                            st = engine.run(prompt, max_new_tokens=args.tokens, ignore_eos=True).stats
                            runs.append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
                        out[phase][setting].append(statistics.median(runs))
                        chosen[phase][setting].append(gov.threads)
                        print(f"[decode] {phase:9s} threads={setting:4s} (ran {gov.threads}) "
                              f"{statistics.median(runs):7.1f} ms/token", flush=True)
    summary = {phase: {s: statistics.median(v) for s, v in d.items()} for phase, d in out.items()}
    return {"ms_per_token_median": summary, "ms_per_token_rounds": out, "threads_used": chosen,
            "auto_over_1_thread_with_neighbour": (summary["neighbour"].get("auto", float("nan"))
                                                  / summary["neighbour"].get("1", float("nan")))
            if "1" in settings and "auto" in settings else None}


def serve_phase(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from llminfer.benchmark.serving import ServingConfig, ServingWorkload, run_serving_benchmark_sync

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "llminfer.cli", "serve", "--model", str(bench_model_path()), "--dtype", args.dtype,
           "--quant", args.quant, "--device", "cpu", "--max-batch-size", str(args.concurrency), "--port", str(port),
           "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    tok_s: dict[str, float] = {}
    try:
        for _ in range(900):
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        cfg = ServingConfig(base_url=base, concurrency=args.concurrency, extra_body={"ignore_eos": True,
                                                                                     "temperature": 0})
        run_serving_benchmark_sync(cfg, ServingWorkload(num_requests=4, output_len=(4, 4), seed=9))  # warm-up
        workload = ServingWorkload(num_requests=args.num_requests, prompt_len=(16, 64), output_len=(16, 64), seed=3)
        for phase in ("quiet_1", "neighbour", "quiet_2"):
            with neighbour(phase == "neighbour", args.neighbour_max_s):
                if phase == "neighbour":
                    time.sleep(1.2)  # the server's auto threads measure every 0.5 s
                s = run_serving_benchmark_sync(cfg, workload).summary
            tok_s[phase] = s["output_tokens_per_s"]
            print(f"[serve] {phase:9s} {s['output_tokens_per_s']:7.1f} output tok/s ({s['failed']} failed)",
                  flush=True)
    finally:
        server.terminate()
        server.wait(60)
    quiet = (tok_s["quiet_1"] + tok_s["quiet_2"]) / 2
    return {"output_tokens_per_s": tok_s, "neighbour_over_quiet": tok_s["neighbour"] / quiet}


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--threads-list", default="1,auto,2", help="comma-separated: auto or a count")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warm-tokens", type=int, default=24)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--neighbour-max-s", type=float, default=300.0, help="the spin loop's bound")
    args = parse_args(ap, {"rounds": 1, "tokens": 8, "warm_tokens": 8, "runs": 1, "num_requests": 8})
    from llminfer.logging import configure_logging

    configure_logging("warning")
    before = loadavg()
    print(f"loadavg before: {before}", flush=True)
    payload: dict[str, Any] = {"benchmark": "busy_neighbour", "dtype": args.dtype, "quant": args.quant,
                               "loadavg_before": before}
    payload["decode"] = decode_phase(args)
    if not args.no_serve:
        payload["serve"] = serve_phase(args)
    payload["loadavg_after"] = loadavg()
    payload["environment"] = environment()
    print(f"loadavg after: {payload['loadavg_after']}")
    d = payload["decode"]
    if d["auto_over_1_thread_with_neighbour"] is not None:
        print(f"[decode] with the neighbour, auto / 1 thread: {d['auto_over_1_thread_with_neighbour']:.2f}")
    if "serve" in payload:
        print(f"[serve] with the neighbour / quiet: {payload['serve']['neighbour_over_quiet']:.2f}")
    print(f"-> {save(f'busy_neighbour_{args.dtype}_{args.quant}', payload)}")
    return payload


if __name__ == "__main__":
    main()
