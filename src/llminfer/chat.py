"""Chat conversations: rendering OpenAI-shaped messages (tool calls and tool results included) with the
model's chat template, and :class:`ChatResult`, what :meth:`llminfer.InferenceEngine.chat` returns. The
HTTP server renders chat prompts with the same code.

Messages are dicts in the OpenAI shape: ``{"role": "system" | "developer" | "user" | "assistant" | "tool",
"content": str | None, "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}],
"tool_call_id": str, "name": str}``.

Templates with tool support (their source mentions ``tools``, as Qwen2.5's, Llama 3.1's and Mistral's do)
get the tools through ``apply_chat_template(..., tools=[...])`` and the assistant calls with their
``arguments`` as dicts (the form those templates expect). **Fallback** for a template without tool
support (the built-in model's, for one):

- the tools are listed, as JSON, in a system-message preamble (:data:`TOOLS_PREAMBLE`, appended to the
  first system message, or a new one) that asks for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``;
- an assistant message's calls are written into its content in that syntax;
- ``role: "tool"`` results become user messages ``<tool_response>\\n...\\n</tool_response>`` (consecutive
  results share one message, so templates that require alternating roles accept them).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError
from llminfer.results import GenerationResult, GenerationStats
from llminfer.sampling.constraint import StructuredOutput
from llminfer.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Tool,
    ToolCall,
    ToolPlan,
    finish_reason,
    parse_tool_calls,
    plan_tools,
)
from llminfer.tools.answer_format import calls_or_answer

ROLES = ("system", "developer", "user", "assistant", "tool")

TOOLS_PREAMBLE = """# Tools

You can call the functions described below, as JSON Schema signatures inside <tools></tools>:
<tools>
{tools}
</tools>

To call one, answer with a JSON object holding its name and arguments between <tool_call></tool_call> tags, \
one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""
"""The fallback system-message text for templates without tool support (``{tools}``: one JSON per line)."""


def template_supports_tools(template: Any) -> bool:
    """True when a chat template (text, or a dict of named templates) renders ``tools`` itself."""
    if isinstance(template, dict):
        return "tool_use" in template or any(template_supports_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


@attrs.frozen
class ChatResult:
    """The outcome of :meth:`llminfer.InferenceEngine.chat`.

    Attributes:
        content: the assistant's text outside tool calls (None when there is none).
        tool_calls: the parsed calls, in order.
        finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"`` (calls, and not cut off).
        text: the raw generated text.
        stats: the request's measurements.
        request_id: the engine request id.
    """

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    text: str
    stats: GenerationStats
    request_id: str

    @classmethod
    def from_result(cls, result: GenerationResult, plan: ToolPlan | None) -> ChatResult:
        """Parse ``result``'s text under ``plan`` (None: no tools, the text is the content)."""
        text = result.generated_text
        if plan is None:
            content, calls = text or None, ()
        else:
            content, calls = parse_tool_calls(text, plan)
        return cls(content, calls, finish_reason(result.finish_reason, bool(calls)), text, result.stats,
                   result.request_id)


def _arguments_dict(arguments: Any, param: str) -> Any:
    """A call's ``arguments`` as templates want them: parsed from JSON text (kept as text if it is not JSON)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    if arguments is None or isinstance(arguments, dict):
        return arguments or {}
    raise InvalidRequestError("function.arguments must be a JSON string", param=param)


def normalize_messages(messages: Sequence[dict[str, Any]], *, param: str = "messages") -> list[dict[str, Any]]:
    """Check OpenAI-shaped messages and convert them to what chat templates take (``developer`` →
    ``system``, content ``None`` → ``""``, call arguments as dicts).

    Raises:
        InvalidRequestError: a message that is not an object, an unknown role, a non-text content, a
            malformed tool call, or a ``tool`` message that does not follow one with ``tool_calls``; ``param`` names it (``messages[2].tool_calls[0].function.name``).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", param=param)
    out = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError("a message must be an object with a 'role'", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role")
        if role == "tool" and not (out and (out[-1]["role"] == "tool" or out[-1].get("tool_calls"))):
            # OpenAI's rule: a result answers the calls of the assistant message just before it.
            raise InvalidRequestError("a 'tool' message must follow an assistant message with 'tool_calls' "
                                      "(or another 'tool' message)", param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidRequestError("content must be a string or null", param=f"{where}.content")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
        if message.get("name") is not None:
            entry["name"] = message["name"]
        if role == "tool" and message.get("tool_call_id") is not None:
            entry["tool_call_id"] = message["tool_call_id"]
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise InvalidRequestError("only assistant messages hold tool_calls", param=f"{where}.tool_calls")
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                cwhere = f"{where}.tool_calls[{j}]"
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InvalidRequestError("a tool call needs function.name", param=f"{cwhere}.function.name")
                args = _arguments_dict(function.get("arguments"), f"{cwhere}.function.arguments")
                entry["tool_calls"].append({"id": call.get("id") or f"call_{i}_{j}", "type": "function",
                                            "function": {"name": function["name"], "arguments": args}})
        out.append(entry)
    return out


def _fallback_conversation(conversation: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template without tool support (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        entry = {"role": role, "content": message["content"]}
        if message.get("tool_calls"):
            blocks = [f"{TOOL_CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                      for c in message["tool_calls"]]
            entry["content"] = "\n".join(([entry["content"]] if entry["content"] else []) + blocks)
        out.append(entry)
    for entry in out:
        entry.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + preamble) if out[0]["content"] else preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template and tokenizes them with one BOS.

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_id: int | None = bos if isinstance(bos, int) else None
        self.adds_bos = False
        if self.bos_id is not None:
            with contextlib.suppress(Exception):
                self.adds_bos = tokenizer.encode("a")[:1] == [self.bos_id]

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[Tool] = (), *,
               chat_template: str | None = None, param: str = "messages") -> str:
        """The prompt text: ``messages`` (OpenAI-shaped, see :func:`normalize_messages`) and ``tools``
        through the chat template (``chat_template`` overrides the tokenizer's), generation prompt added.

        Raises:
            InvalidRequestError: bad messages, no chat template (``code="no_chat_template"``), or messages
                the template rejects; ``param`` names the field.
        """
        conversation = normalize_messages(messages, param=param)
        template = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template", param=param, code="no_chat_template")
        kwargs: dict[str, Any] = {}
        has_tool_messages = any(m["role"] == "tool" or m.get("tool_calls") for m in conversation)
        if template_supports_tools(template):
            if tools:
                kwargs["tools"] = [t.to_openai() for t in tools]
        elif tools or has_tool_messages:
            conversation = _fallback_conversation(conversation, tools)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja TemplateError and the like: the messages' fault
            raise InvalidRequestError(f"the messages could not be rendered with the chat template: {exc}",
                                      param=param) from None

    def fix_bos(self, ids: list[int]) -> list[int]:
        """Exactly one BOS in front when the model uses one (templates often write one, and so might the
        tokenizer)."""
        bos = self.bos_id
        if bos is not None and ids:
            while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
                del ids[0]
            if self.adds_bos and ids[0] != bos:
                ids.insert(0, bos)
        return ids


def chat_turn(engine: Any, messages: Sequence[dict[str, Any]], *, tools: Sequence[Any] | None = None,
              tool_choice: str | dict[str, Any] | None = "auto", parallel_tool_calls: bool = True,
              chat_template: str | None = None, **kwargs: Any) -> ChatResult:
    """One chat turn on ``engine`` (an :class:`~llminfer.engine.InferenceEngine`): ``messages`` (OpenAI-shaped dicts: ``role``, ``content``, assistant ``tool_calls``,
    ``tool`` results with ``tool_call_id``) and ``tools`` through the chat template, then generation,
    with tool calls parsed out of the output (the HTTP server's rendering and parsing; see
    :mod:`llminfer.chat` and :mod:`llminfer.tools`).

    Args:
        messages: the conversation.
        tools: OpenAI tool definitions (``{"type": "function", "function": {"name", "description",
            "parameters"}}``) or :class:`llminfer.tools.Tool` objects.
        tool_choice: ``"auto"`` (the model decides; calls parsed from ``<tool_call>`` blocks), ``"none"``,
            ``"required"`` (constrained to one or more calls) or ``{"type": "function", "function":
            {"name": ...}}`` (constrained to that function's arguments). Ignored without tools when
            ``"auto"`` or ``"none"``.
        parallel_tool_calls: allow more than one call.
        chat_template: a template to use instead of the tokenizer's.
        **kwargs: sampling arguments of :meth:`~llminfer.engine.InferenceEngine.make_request`
            (``structured_output`` only without a constraining ``tool_choice``; with ``"auto"`` the output
            is calls or an answer in that format, :func:`llminfer.tools.answer_format.calls_or_answer`).

    Returns:
        :class:`~llminfer.chat.ChatResult` with ``content``, ``tool_calls``, ``finish_reason``
        (``"tool_calls"`` when the output ended with calls), ``text`` and ``stats``.

    Raises:
        InvalidRequestError: bad messages or tools (``param`` under ``messages`` / ``tools``), a bad
            ``tool_choice``, a ``structured_output`` together with ``required`` or a named function, a
            constraint that does not compile, or a bad sampling value; CapacityError, EngineError as
            :meth:`~llminfer.engine.InferenceEngine.run`.
    """
    engine.load()
    if not tools and tool_choice in ("auto", "none"):
        tool_choice = None
    plan = plan_tools(tools, tool_choice, parallel_tool_calls)
    renderer = ChatRenderer(engine.tokenizer)
    text = renderer.render(messages, plan.tools if plan is not None else (), chat_template=chat_template)
    ids = renderer.fix_bos(list(engine.inputs.encode(text, param="messages", add_special_tokens=False)))
    constraint = plan.structured_output if plan is not None else None
    answer = kwargs.get("structured_output")
    if plan is not None and plan.mode == "auto" and isinstance(answer, StructuredOutput):
        # calls, or an answer in the format (as the HTTP server serves tools with a response_format)
        kwargs["structured_output"] = calls_or_answer(plan, answer, answer_param="structured_output",
                                                      tokenizer=engine.tokenizer)
    elif constraint is not None:
        if kwargs.get("structured_output") is not None:
            raise InvalidRequestError(f"structured_output cannot be combined with tool_choice={plan.mode!r}",
                                      param="structured_output")
        kwargs["structured_output"] = constraint
    result = engine.run(ids, **kwargs)
    return ChatResult.from_result(result, plan if plan is not None and plan.mode != "none" else None)
