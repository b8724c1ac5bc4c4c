"""Write the example notebooks (clean cells, no outputs) from the cell sources below.

    python tools/make_notebooks.py

Edit the cells here, not in the .ipynb files, so the notebooks stay reviewable and output-free.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

QUICKSTART = [
    ("md", """# llminfer quickstart

Install (once, from the repository root):

```bash
pip install torch==2.13.0 && pip install -e ".[dev]"
```

This notebook runs offline on the **built-in tiny model** (random weights, real Qwen2 tokenizer: the text is
meaningless by design). Put a real model in `MODEL`, e.g. `"Qwen/Qwen2.5-0.5B-Instruct"`, to read real text.
Set `HEAVY = True` for the larger benchmark section."""),
    ("code", """import os, tempfile
from pathlib import Path

from llminfer import EngineConfig, InferenceEngine

MODEL = None          # None = the built-in model; or a Hugging Face id / local folder
HEAVY = os.environ.get("LLMINFER_NOTEBOOK_HEAVY") == "1"
OUT = Path(tempfile.mkdtemp(prefix="llminfer-quickstart-"))
engine = InferenceEngine(EngineConfig(model_name=MODEL, max_batch_size=8)).load().start()
print("loaded:", engine.info()["architecture"], f"{engine.info()['parameters']:,} parameters")"""),
    ("md", "## Run one prompt"),
    ("code", """result = engine.run("Hello, my name is", max_new_tokens=16)
print(repr(result.generated_text))
print("finish:", result.finish_reason, "| TTFT %.1f ms | %.1f tok/s" % (result.stats.ttft_ms,
      result.stats.throughput_tokens_per_sec))"""),
    ("md", "## Stream tokens as they arrive"),
    ("code", """pieces = []
for chunk in engine.stream("Tell me about paged attention", max_new_tokens=16):
    pieces.append(chunk.token)
print("chunks:", len(pieces))
print("joined:", repr("".join(pieces)))"""),
    ("md", """## Static vs continuous batching

Static batching runs a group until its longest request finishes; continuous batching refills free slots
every step. Outputs of different lengths show the difference."""),
    ("code", """import time

prompts = [f"Request {i}: " + "word " * (4 * i + 2) for i in range(8)]
lengths = [4, 32, 6, 28, 8, 24, 10, 20]

def timed(fn):
    t = time.perf_counter(); out = fn(); return time.perf_counter() - t, out

reqs = lambda: [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
t_cont, _ = timed(lambda: engine.run_requests(reqs()))
t_static, _ = timed(lambda: [engine.run_requests(reqs()[i:i + 4]) for i in (0, 4)])
print(f"continuous: {t_cont:.2f} s   static (groups of 4): {t_static:.2f} s")"""),
    ("md", "## Prefix cache"),
    ("code", """system = "You are a concise assistant. " * 8
engine.run(system + "First question?", max_new_tokens=4)
again = engine.run(system + "Second question?", max_new_tokens=4)
print("cache hit:", again.stats.cache_hit, "| cached tokens:", again.stats.cached_tokens)
print(engine.cache_stats())"""),
    ("md", "## Benchmark and plots (artifacts saved, plots shown from the files)"),
    ("code", """from IPython.display import Image, display
from llminfer.benchmark import Benchmarker

sizes = [1, 2, 4, 8] if HEAVY else [1, 4]
bench = Benchmarker(engine, prompt_len=16).run(batch_sizes=sizes, num_runs=2 if HEAVY else 1, max_new_tokens=16)
bench.print_summary()
paths = bench.save_artifacts(OUT)
plots = bench.plot_suite(OUT, prefix="quickstart")
print("artifacts:", paths["json"].name, paths["csv"].name, "| plots:", [p.name for p in plots])
display(Image(filename=str(plots[0])))"""),
    ("code", """engine.close()
print("done")"""),
]

SERVING = [
    ("md", """# Serving llminfer behind an OpenAI-compatible API

Starts `llminfer serve` on the built-in model (offline), then talks to it with the official `openai`
client: a plain call, a streaming call, a small concurrency test, and the Prometheus metrics. Put a real
model in `MODEL` to read real text."""),
    ("code", """import os, socket, subprocess, sys, time

import httpx

MODEL = None   # None = built-in; e.g. "Qwen/Qwen2.5-0.5B-Instruct"
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); PORT = sock.getsockname()[1]; sock.close()
cmd = [sys.executable, "-m", "llminfer.cli", "serve", "--host", "127.0.0.1", "--port", str(PORT)]
if MODEL:
    cmd += ["--model", MODEL]
server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
BASE = f"http://127.0.0.1:{PORT}"
for _ in range(600):
    try:
        if httpx.get(BASE + "/healthz", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.2)
print("server up on", BASE)"""),
    ("md", "## A chat completion"),
    ("code", """from openai import OpenAI

client = OpenAI(base_url=BASE + "/v1", api_key="unused")
model_id = client.models.list().data[0].id
reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello!"}],
                                       max_tokens=16)
print(model_id, "->", repr(reply.choices[0].message.content), "| finish:", reply.choices[0].finish_reason)
print("usage:", reply.usage)"""),
    ("md", "## Streaming"),
    ("code", """stream = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=16, stream=True)
pieces = [c.choices[0].text for c in stream if c.choices]
print(len(pieces), "chunks:", repr("".join(pieces)))"""),
    ("md", "## A small concurrency test"),
    ("code", """from concurrent.futures import ThreadPoolExecutor

def one(i):
    t = time.perf_counter()
    r = client.completions.create(model=model_id, prompt=f"Request {i}", max_tokens=16)
    return time.perf_counter() - t, r.usage.completion_tokens

t0 = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(one, range(16)))
wall = time.perf_counter() - t0
print(f"16 requests, 8 at a time: {wall:.2f} s, {sum(n for _, n in results) / wall:.1f} output tok/s")"""),
    ("md", "## Metrics"),
    ("code", """metrics = httpx.get(BASE + "/metrics").text
print("\\n".join(l for l in metrics.splitlines() if l.startswith("llminfer_") and "bucket" not in l)[:2000])"""),
    ("code", """server.terminate(); server.wait(30)
print("server stopped")"""),
]


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    for name, cells in (("llminfer_quickstart.ipynb", QUICKSTART), ("llminfer_serving.ipynb", SERVING)):
        path = EXAMPLES / name
        nbformat.write(build(cells), path)
        print("wrote", path)


if __name__ == "__main__":
    main()
