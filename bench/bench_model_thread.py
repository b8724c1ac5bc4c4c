"""Batch-1 CPU decode with the engine's one model thread against steps on anyio's worker threads.

The engine loads the model and runs every step on one thread (:mod:`llminfer.core.model_thread`), so
torch's OpenMP keeps a single thread team; ``LLMINFER_MODEL_THREAD=0`` restores the old placement (load in
the calling thread, steps on whichever anyio worker is free), where libgomp manages more threads than CPUs,
throttles its spin-wait and puts its workers to sleep between the step's parallel regions.

With ``--run-on``, the steps stay on the model thread and the settings are the engine core's runs of steps on
the model thread between two visits to the event loop (``LLMINFER_STEPS_ON_MODEL_THREAD=1``, the default) against
a return to the event loop after every step (``=0``).

With ``--foreign-team``, the steps stay on the model thread and the main thread starts an OpenMP team of its
own (one large ``copy_``, as any torch op of more than 32768 elements there does) before the timed runs; the
settings are then the kernels' parallel loops on torch's OpenMP team (``LLMINFER_KERNEL_THREAD_POOL=0``)
(the default) against llminfer's own worker threads (``csrc/thread_pool.h``, ``=1``), which libgomp's
throttling does not reach. Without it, both settings keep the kernels on OpenMP.

Each setting runs in its own process (a fresh OpenMP runtime), alternating for ``--rounds`` rounds, for
each ``--quant`` and ``--backends`` pair: batch-1 decode ms/token on the bench model (median of 3 runs of
``--tokens`` tokens after a warm-up run), with the share of CPU time stolen by the hypervisor during it.

    python bench/bench_model_thread.py [--rounds 2] [--quant none,int8-wo] [--backends eager,compiled]
    python bench/bench_model_thread.py --foreign-team [--rounds 2] [--quant none] [--backends eager]
    python bench/bench_model_thread.py --run-on [--rounds 2] [--quant none,int8-wo] [--backends eager]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
from common import BENCH_VOCAB, bench_model_path, random_prompts
from llminfer import EngineConfig, InferenceEngine
from llminfer.benchmark.environment import StealMeter
from llminfer.config import QuantConfig, QuantMode
from llminfer.logging import configure_logging
configure_logging("warning")
quant, backend, tokens, foreign = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
cfg = EngineConfig(model_name=str(bench_model_path()), dtype="float32", device="cpu", max_batch_size=1,
                   batch_timeout_ms=0, quant=QuantConfig(mode=QuantMode(quant)), backend=backend)
with InferenceEngine(cfg) as engine:
    prompt = random_prompts(1, 8, BENCH_VOCAB, seed=1)[0]
    engine.run(prompt, max_new_tokens=4, ignore_eos=True)
    if foreign:  # a second OpenMP team, on this (the main) thread
        import torch
        big = torch.ones(4096, 4096)
        big.clone().copy_(big)
    steal, tpot = StealMeter(), []
    for _ in range(3):
        st = engine.run(prompt, max_new_tokens=tokens, ignore_eos=True).stats
        tpot.append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
print("RESULT " + json.dumps({"ms_per_token": statistics.median(tpot), "runs_ms": tpot, "steal_pct": steal.pct()}))
"""


def run_setting(model_thread: bool, quant: str, backend: str, tokens: int, foreign_team: bool = False,
                thread_pool: bool = False, run_on: bool = True) -> dict[str, Any]:
    from common import run_child

    env = {**os.environ, "LLMINFER_MODEL_THREAD": "1" if model_thread else "0",
           "LLMINFER_KERNEL_THREAD_POOL": "1" if thread_pool else "0",
           "LLMINFER_STEPS_ON_MODEL_THREAD": "1" if run_on else "0"}
    return run_child(_CHILD, [str(HERE), quant, backend, str(tokens), "1" if foreign_team else "0"], env,
                     f"bench_model_thread: the run ({quant}, {backend}, model thread {model_thread}, "
                     f"kernel thread pool {thread_pool}, runs on the model thread {run_on})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quant", type=lambda v: v.split(","), default=["none", "int8-wo"])
    ap.add_argument("--backends", type=lambda v: v.split(","), default=["eager", "compiled"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--foreign-team", action="store_true",
                    help="model thread, a second OpenMP team on the main thread: OpenMP against llminfer's workers")
    ap.add_argument("--run-on", action="store_true",
                    help="model thread, runs of steps on it against a return to the event loop after every step")
    args = ap.parse_args(argv)
    if args.run_on and args.foreign_team:
        ap.error("--run-on and --foreign-team are separate comparisons: pass one")
    from common import environment, save

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    for quant in args.quant:
        for backend in args.backends:
            for r in range(args.rounds):
                for second in (False, True):
                    model_thread, pool = (True, second) if args.foreign_team else (second, False)
                    run_on = second or not args.run_on
                    model_thread = model_thread or args.run_on
                    res = run_setting(model_thread, quant, backend, args.tokens, args.foreign_team, pool, run_on)
                    res.update(round=r, quant=quant, backend=backend, model_thread=model_thread,
                               foreign_team=args.foreign_team, kernel_thread_pool=pool, runs_on_model_thread=run_on)
                    rows.append(res)
                    steal = "n/a" if res["steal_pct"] is None else f"{res['steal_pct']:.1f} %"
                    if args.run_on:
                        where = "model thread, runs" if run_on else "model thread, one "
                    elif args.foreign_team:
                        where = "llminfer workers " if pool else "OpenMP team      "
                    else:
                        where = "one model thread " if model_thread else "anyio's workers  "
                    print(f"{quant:8s} {backend:8s} round {r} steps on {where} {res['ms_per_token']:6.1f} ms/token "
                          f"(runs {', '.join(f'{x:.1f}' for x in res['runs_ms'])}), steal {steal}", flush=True)
    payload = {"benchmark": "model_thread", "rows": rows, "loadavg_before": load_before,
               "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "environment": environment()}
    name = "model_thread_foreign_team" if args.foreign_team else "model_thread_run_on" if args.run_on else "model_thread"
    print(f"-> {save(name, payload)}")
    return payload


if __name__ == "__main__":
    main()
