"""OpenMP spin-waiting and the CPU decode step on a VM: libgomp's default against a long ``GOMP_SPINCOUNT``.

libgomp lets an idle worker spin before it sleeps, but cuts that spin to 1,000 iterations once it manages
more threads than there are CPUs: that happens as soon as a second thread runs parallel regions. The engine
no longer does that itself (it loads and steps on one model thread, ``llminfer.core.model_thread``; see
``bench_model_thread.py``), but the ``spin`` check below does it on purpose before the decode check, as a
user's own threads would. The worker then sleeps and is
woken at every region of the step (one per layer), and on a VM a halted vCPU comes back through the
hypervisor, which the guest counts as steal. ``GOMP_SPINCOUNT`` sets both spin counts; libgomp reads it when
it loads, so each setting runs in its own process.

Two checks per setting, alternating settings for ``--rounds`` rounds:

* ``spin``: CPU time over wall time of 50 parallel sums with 5 ms gaps, on the main thread and then on a
  second thread (about 2 where the worker spins through the gaps, about 1 or less where it sleeps);
* ``decode``: llminfer's batch-1 decode ms/token on the bench model (eager, ``--quant``, median of 3 runs of
  64 tokens), with the share of CPU time stolen by the hypervisor during it.

    python bench/bench_omp_spin.py [--rounds 2] [--quant int8-wo] [--spincount 20000000]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, os, resource, statistics, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(os.environ.get("LLMINFER_BENCH_THREADS", "2")))

def cpu_over_wall():
    x = torch.randn(2048, 2048)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(50):
        x.sum()
        time.sleep(0.005)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (t1 - t0)

out = {"main_thread": cpu_over_wall()}
box = {}
t = threading.Thread(target=lambda: box.update(v=cpu_over_wall()))
t.start()
t.join()
out["second_thread"] = box["v"]

from common import BENCH_VOCAB, bench_model_path, random_prompts
from llminfer import EngineConfig, InferenceEngine
from llminfer.benchmark.environment import StealMeter
from llminfer.config import QuantConfig, QuantMode
from llminfer.logging import configure_logging
configure_logging("warning")
cfg = EngineConfig(model_name=str(bench_model_path()), dtype="float32", device="cpu", max_batch_size=1,
                   batch_timeout_ms=0, quant=QuantConfig(mode=QuantMode(sys.argv[2])))
with InferenceEngine(cfg) as engine:
    prompt = random_prompts(1, 8, BENCH_VOCAB, seed=1)[0]
    engine.run(prompt, max_new_tokens=4, ignore_eos=True)
    steal, tpot = StealMeter(), []
    for _ in range(3):
        st = engine.run(prompt, max_new_tokens=64, ignore_eos=True).stats
        tpot.append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
out.update(ms_per_token=statistics.median(tpot), runs_ms=tpot, steal_pct=steal.pct())
print("RESULT " + json.dumps(out))
"""


def run_setting(spincount: str | None, quant: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spincount is not None:
        env["GOMP_SPINCOUNT"] = spincount
    from common import run_child

    return run_child(_CHILD, [str(HERE), quant], env, f"bench_omp_spin: the GOMP_SPINCOUNT={spincount or 'default'} run")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quant", default="int8-wo", help="--quant of the decode check (none, int8-wo, int4-wo)")
    ap.add_argument("--spincount", default="20000000", help="the GOMP_SPINCOUNT set against the default")
    args = ap.parse_args(argv)
    from common import environment, save

    rows = []
    for r in range(args.rounds):
        for spincount in (None, args.spincount):
            res = run_setting(spincount, args.quant)
            res.update(round=r, gomp_spincount=spincount or "default")
            rows.append(res)
            steal = "n/a" if res["steal_pct"] is None else f"{res['steal_pct']:.1f} %"
            print(f"round {r} GOMP_SPINCOUNT={res['gomp_spincount']:<9} cpu/wall main thread "
                  f"{res['main_thread']:.2f}, second thread {res['second_thread']:.2f}; batch-1 {args.quant} "
                  f"{res['ms_per_token']:.1f} ms/token (runs {', '.join(f'{x:.1f}' for x in res['runs_ms'])}), "
                  f"steal {steal}", flush=True)
    payload = {"benchmark": "omp_spin", "quant": args.quant, "rows": rows, "environment": environment()}
    print(f"-> {save('omp_spin', payload)}")
    return payload


if __name__ == "__main__":
    main()
