"""Assemble a pipeline from llminfer's public stages, with two stages of your own.

* ``RedactStage`` sits between detokenize and the sink and rewrites text deltas (a filter).
* ``JsonlRecorder`` is a pass-through stage that appends every delta to a JSON Lines file.

Runs offline on the built-in model:  python examples/custom_pipeline.py [out.jsonl]
(Put a real model in ``EngineConfig(model_name="Qwen/Qwen2.5-0.5B-Instruct")`` to get readable text.)
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import anyio
import attrs

from llminfer import EngineConfig, InferenceEngine, Pipeline, SamplingParams
from llminfer.protocols.messages import DeltaBatch, GenerationRequest


class RedactStage:
    """Replaces every vowel with '*' in streamed text: any transformation of deltas works the same way."""

    name = "redact"

    async def run(self, inbox, outbox):
        async with outbox:
            async for msg in inbox:
                if isinstance(msg, DeltaBatch):
                    msg = attrs.evolve(msg, deltas=tuple(
                        attrs.evolve(d, text="".join("*" if ch in "aeiouAEIOU" else ch for ch in d.text))
                        for d in msg.deltas
                    ))
                await outbox.send(msg)


class JsonlRecorder:
    """Writes each delta as one JSON line, then passes the batch on unchanged."""

    name = "jsonl_recorder"

    def __init__(self, path: Path) -> None:
        self.path = path

    async def run(self, inbox, outbox):
        async with outbox:
            with self.path.open("a", encoding="utf-8") as f:
                async for msg in inbox:
                    if isinstance(msg, DeltaBatch):
                        for d in msg.deltas:
                            f.write(json.dumps({"request_id": d.request_id, "text": d.text,
                                                "token_ids": list(d.token_ids),
                                                "finish_reason": d.finish_reason}) + "\n")
                        f.flush()
                    await outbox.send(msg)


async def generate_all(pipeline: Pipeline, prompts: list[str], max_new_tokens: int) -> dict[str, str]:
    """Submit every prompt, read every request's deltas; return the text per prompt."""
    texts: dict[str, str] = {}

    async def one(prompt: str) -> None:
        request = GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_new_tokens=max_new_tokens),
                                    time.perf_counter_ns())
        stream = await pipeline.submit(request)
        parts = []
        async with stream:
            async for delta in stream:
                parts.append(delta.text)
        texts[prompt] = "".join(parts)

    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)
    return texts


def main(out_path: str = "custom_pipeline.jsonl", max_new_tokens: int = 16) -> dict[str, str]:
    engine = InferenceEngine(EngineConfig()).load()
    out = Path(out_path)
    out.unlink(missing_ok=True)
    pipeline = engine.build_pipeline(after_detokenize=[RedactStage(), JsonlRecorder(out)])

    async def go() -> dict[str, str]:
        async with pipeline:
            return await generate_all(pipeline, ["Hello there", "Paged attention is"], max_new_tokens)

    texts = anyio.run(go)
    for prompt, text in texts.items():
        print(f"{prompt!r} -> {text!r}")
    print(f"{sum(1 for _ in out.open())} deltas recorded in {out}")
    return texts


if __name__ == "__main__":
    main(*sys.argv[1:2])
