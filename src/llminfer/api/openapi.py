"""Corrections to the OpenAPI document Litestar generates (``/schema/openapi.json``).

Litestar drops falsy limits when it turns msgspec ``Meta`` constraints into schema keywords (``ge=0`` gives no
``minimum``, so ``temperature`` would look unbounded below), and limits on one member of a union (the 16
strings of ``stop``). msgspec's own JSON Schema generator keeps all of them, so :func:`refine_openapi` puts
msgspec's schema of every wire struct in the document's components in place of Litestar's. It also adds the
``text/event-stream`` form of the streaming endpoints' 200 response, and the stream chunk schemas it names.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Schema

from llminfer.api import protocol as s
from llminfer.api import responses as r

#: the structs whose schema the document carries: request bodies and responses (with the structs they use)
WIRE_STRUCTS: tuple[type, ...] = (
    s.ChatCompletionRequest, s.CompletionRequest, r.ResponsesRequest, s.ChatCompletion, s.ChatCompletionChunk,
    s.Completion, r.Response, s.ModelList, s.ModelCard, s.Health,
)

_STREAMS = {
    "/v1/chat/completions": "With `stream: true`: `data:` lines, each a `ChatCompletionChunk` "
                            "(#/components/schemas/ChatCompletionChunk), then `data: [DONE]`. Lines starting "
                            "with `:` are keep-alive comments.",
    "/v1/completions": "With `stream: true`: `data:` lines, each a `Completion` (#/components/schemas/Completion) "
                       "with the next piece of text, then `data: [DONE]`. Lines starting with `:` are keep-alive "
                       "comments.",
    "/v1/responses": "With `stream: true`: typed events (`event: <type>` and a `data:` JSON object with the same "
                     "`type` and a `sequence_number`): response.created, response.in_progress, "
                     "response.output_item.added, response.content_part.added, response.output_text.delta..., "
                     "response.output_text.done, response.content_part.done, response.output_item.done, then "
                     "response.completed or response.incomplete, each carrying a `Response` "
                     "(#/components/schemas/Response). Lines starting with `:` are keep-alive comments.",
}


def refine_openapi(app: Litestar) -> None:
    """Build ``app``'s OpenAPI document now and correct it (see the module docstring).

    Call it once the app has all its routes. The document is cached by Litestar, so this costs nothing later.
    """
    openapi = app.plugins.get(OpenAPIPlugin).provide_openapi()
    _, components = msgspec.json.schema_components(WIRE_STRUCTS, ref_template="#/components/schemas/{name}")
    schemas: dict[str, Any] = dict(openapi.components.schemas or {})
    schemas.update(components)  # msgspec's schema keeps every limit (Litestar's drops zero minimums)
    openapi.components.schemas = schemas
    for path, description in _STREAMS.items():
        item = openapi.paths.get(path) if openapi.paths else None
        if item is None or item.post is None or item.post.responses is None:
            continue
        ok = item.post.responses.get("200")
        content = getattr(ok, "content", None)
        if content is not None:
            content["text/event-stream"] = OpenAPIMediaType(schema=Schema(type=OpenAPIType.STRING, description=description))
