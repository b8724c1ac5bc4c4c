"""Parsing tool calls out of generated text, incrementally (:class:`ToolCallParser`: ``feed`` text as it is
generated, then ``finish``), into content strings and :class:`ToolCallDelta` fragments; the non-streamed
result is the fold of the same events (:func:`fold_events`), so streamed and non-streamed answers agree by
construction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

import attrs

from llminfer.tools.definitions import ToolPlan

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@attrs.frozen
class ToolCall:
    """One parsed call.

    Attributes:
        id: ``call_<hex>``.
        name: the function called.
        arguments: its arguments as JSON text (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str
    type: str = "function"

    def parsed_arguments(self) -> Any:
        """``json.loads(arguments)``. Raises ValueError when the text is not JSON (a truncated output)."""
        return json.loads(self.arguments)


@attrs.frozen
class ToolCallDelta:
    """A fragment of the ``index``-th call: the first one of a call carries ``id`` and ``name``, every one
    carries a piece of ``arguments`` (the call's arguments are their concatenation)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = str | ToolCallDelta  #: content text, or a fragment of a call


def new_call_id() -> str:
    """A fresh ``call_<24 hex>`` id."""
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_json(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one ``{"name": ..., "arguments": ...}`` object, or None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    # Some models write "parameters" for "arguments"; arguments given as a JSON string are kept as they are.
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _bare_json_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]]:
    """The calls of an output made only of JSON call objects (Llama 3.x's tool-call syntax: one object, or
    several separated by ``;`` or whitespace, or a JSON array of them); empty if anything else is in it."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == n:
            return calls
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        for item in obj if isinstance(obj, list) else [obj]:
            parsed = _call_from_json(json.dumps(item), names) if isinstance(item, dict) else None
            if parsed is None:
                return []
            calls.append(parsed)


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``: text that may
    still become a call once more arrives, so it is held back."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental parser of one output under a :class:`ToolPlan`.

    :meth:`feed` takes text as it is generated and returns the events that are certain so far;
    :meth:`finish` returns the rest at the end. Events are content strings and :class:`ToolCallDelta`.

    In ``auto`` mode, calls are Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks, or an output that is
    only JSON call objects (Llama 3.x: ``{"name": ..., "parameters": {...}}``, several separated by ``;``);
    an output starting with ``{`` is therefore held back to its end. Text that could still be the start of
    ``<tool_call>`` is held back, whitespace just
    before a call or just after one is dropped (``"</tool_call>\\n<tool_call>"`` has no content between), and
    an unclosed or malformed block is given back as content. Without ``parallel_tool_calls`` only the first
    call is kept.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.names = frozenset(t.name for t in plan.tools)
        self.calls = 0
        self._buffer = ""
        self._in_call = False
        self._after_call = False  # only whitespace since the last call
        self._gap = ""  # that whitespace: it separates the content before the call from what follows
        self._before = ""  # whitespace stripped in front of an open block (given back if it is malformed)
        self._content_seen = False
        self._maybe_bare: bool | None = None  # the output starts with "{" (None: no text yet)
        self._named_id: str | None = None

    def feed(self, text: str) -> list[Event]:
        """Events made certain by ``text`` (appended to what came before)."""
        mode = self.plan.mode
        if mode == "none":
            return [text] if text else []
        if mode == "named":
            if not text and self._named_id is not None:
                return []
            events: list[Event] = []
            if self._named_id is None:
                assert self.plan.function is not None
                self._named_id = new_call_id()
                self.calls = 1
                events.append(ToolCallDelta(0, "", self._named_id, self.plan.function.name))
            if text:
                events.append(ToolCallDelta(0, text))
            return events
        self._buffer += text
        if mode == "required":
            return []  # one JSON document: parsed whole at the end
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        """The remaining events, once the output is complete."""
        mode = self.plan.mode
        if mode == "named":
            return self.feed("") if self._named_id is None else []
        if mode == "required":
            return self._finish_required()
        if mode == "auto":
            return self._scan(final=True)
        return []

    def _finish_required(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        try:
            items = json.loads(text)
        except ValueError:
            items = _complete_items(text)  # cut off by max_tokens: the calls completed before the cut
        calls = []
        if isinstance(items, list) and items:
            for item in items:
                parsed = _call_from_json(json.dumps(item), self.names) if isinstance(item, dict) else None
                if parsed is None:
                    calls = []
                    break
                calls.append(parsed)
        if not calls:  # cut off before one call completed (max_tokens): what was generated is returned as content
            return [text] if text else []
        events: list[Event] = []
        for name, args in calls:
            events.append(ToolCallDelta(self.calls, args, new_call_id(), name))
            self.calls += 1
        return events

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        self._content_seen = True
        return [text]

    def _emit_call(self, block: str) -> list[Event]:
        parsed = _call_from_json(block, self.names)
        before, self._before = self._before, ""
        if parsed is None:
            return self._content(before + TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE)
        self._after_call, self._gap = True, ""
        if self.calls and not self.plan.parallel_tool_calls:
            return []  # one call only: later ones are dropped
        name, args = parsed
        event = ToolCallDelta(self.calls, args, new_call_id(), name)
        self.calls += 1
        return [event]

    def _scan(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    if final:  # unclosed (the output was cut off): given back as content
                        events += self._content(self._before + TOOL_CALL_OPEN + self._buffer)
                        self._buffer = self._before = ""
                    return events
                block = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                events += self._emit_call(block)
                continue
            if self._after_call:
                # Whitespace after a call is kept aside: dropped before another call or the end, kept as
                # the separator when content follows content.
                stripped = self._buffer.lstrip()
                self._gap += self._buffer[: len(self._buffer) - len(stripped)]
                self._buffer = stripped
                if not stripped or (not final and TOOL_CALL_OPEN.startswith(stripped)):
                    return events  # nothing yet, or perhaps the next call: wait for more
                self._after_call = False
                if self._content_seen and not stripped.startswith(TOOL_CALL_OPEN):
                    self._buffer = self._gap + stripped
                self._gap = ""
            if self._maybe_bare is None and self._buffer.strip():
                self._maybe_bare = self._buffer.lstrip().startswith("{")  # decided once: no copy per token
            if self._maybe_bare and not self._content_seen and not self.calls:
                # Perhaps Llama 3.x's bare JSON call(s): an output that is only ``{"name": ..., "parameters":
                # ...}`` objects (separated by ";" or whitespace). Only the whole output can tell.
                if not final:
                    return events
                bare = _bare_json_calls(self._buffer, self.names)
                if bare:
                    self._buffer = ""
                    for name, args in bare[: None if self.plan.parallel_tool_calls else 1]:
                        events.append(ToolCallDelta(self.calls, args, new_call_id(), name))
                        self.calls += 1
                    return events
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                content = self._buffer[:start].rstrip()  # whitespace before a call is not content
                self._before = self._buffer[len(content):start]
                events += self._content(content)
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._in_call = True
                continue
            if final:
                events += self._content(self._buffer)
                self._buffer = ""
                return events
            hold = _partial_open_len(self._buffer)
            body = self._buffer[: len(self._buffer) - hold]
            ready = body.rstrip()  # trailing whitespace waits: a call may follow
            events += self._content(ready)
            self._buffer = self._buffer[len(ready):]
            return events


def fold_events(events: Iterable[Event]) -> tuple[str | None, tuple[ToolCall, ...]]:
    """``(content, calls)`` from parser events; content is None when empty."""
    content: list[str] = []
    calls: dict[int, list[Any]] = {}
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif event.index not in calls:
            calls[event.index] = [event.id or new_call_id(), event.name or "", event.arguments]
        else:
            calls[event.index][2] += event.arguments
    text = "".join(content)
    return (text or None), tuple(ToolCall(i, n, a) for i, n, a in (calls[k] for k in sorted(calls)))


def _complete_items(text: str) -> list[Any] | None:
    """The elements of a JSON array cut off before its end (``[{...},{...},{"na``) that were complete, in
    order; None where ``text`` does not start an array or no element completed."""
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return None
    items, at = [], at + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        if at >= len(text) or text[at] != ",":
            break
        at += 1
    return items or None


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, tuple[ToolCall, ...]]:
    """Parse a whole output under ``plan``: ``(content or None, calls)``."""
    parser = ToolCallParser(plan)
    return fold_events([*parser.feed(text), *parser.finish()])


def finish_reason(reason: str | None, has_calls: bool) -> str:
    """OpenAI's ``finish_reason``: ``"tool_calls"`` when the output ended with calls (not when cut off)."""
    reason = reason or "stop"
    return "tool_calls" if has_calls and reason != "length" else reason
