"""A stub OpenAI-style streaming server with fixed delays, for the serving-benchmark test.

    python tests/stub_sse_server.py PORT TTFT_S TPOT_S TOKENS

Every POST answers with SSE: a role-only chunk at once (the TTFT trap), then TOKENS text chunks, the first
after TTFT_S seconds and the others TPOT_S apart, a usage chunk and ``data: [DONE]``. Chunks are chat deltas,
or ``text`` chunks on ``/v1/completions``. ``GET /v1/models`` lists one model, "stub", owned by "stub-org";
every response carries the header ``server: stub-sse/1.0``; any other GET answers ``ok``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn

PORT, TTFT_S, TPOT_S, TOKENS = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    server = (b"server", b"stub-sse/1.0")
    if scope["method"] == "GET":
        if scope["path"] == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "stub-org"}]})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), server]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain"), server]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    chat = scope["path"] != "/v1/completions"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), server]})

    async def event(obj):
        await send({"type": "http.response.body", "body": f"data: {json.dumps(obj)}\n\n".encode(), "more_body": True})

    await event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    await asyncio.sleep(TTFT_S)
    for i in range(TOKENS):
        if i:
            await asyncio.sleep(TPOT_S)
        await event({"choices": [{"index": 0, "delta": {"content": f"t{i} "}} if chat else
                                 {"index": 0, "text": f"t{i} "}]})
    await event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": TOKENS + 3}})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning", server_header=False)
