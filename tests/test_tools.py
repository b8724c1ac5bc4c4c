"""Tool calling without a server: the ``<tool_call>`` parser (whole and streamed), ``tool_choice`` plans,
chat-template rendering of tools and tool results (a template with tool support, and the fallback), and
:meth:`InferenceEngine.chat` on the built-in model."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from helpers import ADD, TOOLS
from llminfer import ChatResult, EngineConfig, InferenceEngine, InvalidRequestError
from llminfer.chat import TOOLS_PREAMBLE, ChatRenderer, template_supports_tools
from llminfer.models.builtin import extract_builtin_tokenizer
from llminfer.sampling.structured import StructuredOutput
from llminfer.tools import ToolCallParser, fold_events, parse_tool_calls, plan_tools, required_schema
from llminfer.tools.answer_format import calls_or_answer

# A Qwen2.5-like template with tool support, written for these tests: tools in the system turn, calls as
# <tool_call> blocks with ``arguments`` through tojson (so a dict renders as an object), results as
# <tool_response> in a user turn.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
]


def _streamed(text: str, plan, step: int = 1):
    parser = ToolCallParser(plan)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    return fold_events(events)


def _pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---------------------------------------------------------------------------- parsing
AUTO_CASES = [
    # (text, content, calls)
    ("Plain answer.", "Plain answer.", []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None, [("add", {"a": 1, "b": 2})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo", "days": 1}), ("add", {"a": 3, "b": 4})]),
    ('A <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>\nB', "A\nB", [("add", {"a": 1, "b": 1})]),
    # malformed JSON, an unknown tool, and an unclosed block stay content
    ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     []),
    ('ok <tool_call>{"name": "add", "arguments": {"a"', 'ok <tool_call>{"name": "add", "arguments": {"a"', []),
    # "parameters" for "arguments", and arguments given as JSON text
    ('<tool_call>{"name": "add", "parameters": {"a": 5, "b": 6}}</tool_call>', None, [("add", {"a": 5, "b": 6})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 7, \\"b\\": 8}"}</tool_call>', None, [("add", {"a": 7, "b": 8})]),
    ("a <tool_c", "a <tool_c", []),
    # Llama 3.x: the output is only JSON call objects
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "add", "parameters": {"a": 1}} and more', '{"name": "add", "parameters": {"a": 1}} and more', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), AUTO_CASES)
def test_auto_parsing_whole_and_streamed(text, content, calls):
    plan = plan_tools(TOOLS, "auto")
    got_content, got_calls = parse_tool_calls(text, plan)
    assert got_content == content
    assert _pairs(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 and c.type == "function" for c in got_calls)
    for step in (1, 3, 7):  # streamed in pieces: the same content and calls
        s_content, s_calls = _streamed(text, plan, step)
        assert s_content == content and _pairs(s_calls) == calls


def test_auto_holds_back_a_possible_call_start():
    parser = ToolCallParser(plan_tools(TOOLS, "auto"))
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may start a call: held back
    assert parser.feed("box> there") == [" <toolbox> there"]
    assert parser.finish() == []


def test_auto_without_parallel_keeps_the_first_call():
    plan = plan_tools(TOOLS, "auto", parallel_tool_calls=False)
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "add", ' \
           '"arguments": {"a": 3, "b": 4}}</tool_call>'
    assert _pairs(parse_tool_calls(text, plan)[1]) == [("add", {"a": 1, "b": 2})]


def test_none_mode_parses_nothing():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert parse_tool_calls(text, plan_tools(TOOLS, "none")) == (text, ())


def test_required_and_named_parsing():
    required = plan_tools(TOOLS, "required")
    text = '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"x","days":3}}]'
    content, calls = parse_tool_calls(text, required)
    assert content is None and _pairs(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "x", "days": 3})]
    assert parse_tool_calls('[{"name":"add","argu', required) == ('[{"name":"add","argu', ())  # cut off
    # cut off after complete calls (a model repeating its call to max_tokens): those calls, no wire text as content
    looped = '[{"name":"add","arguments":{"a":1,"b":2}}, {"name":"add","arguments":{"a":1,"b":2}},{"name":"ad'
    for content, calls in (parse_tool_calls(looped, required), _streamed(looped, required, 7)):
        assert content is None and _pairs(calls) == [("add", {"a": 1, "b": 2})] * 2
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    content, calls = _streamed('{"a":1,"b":2}', named, 2)
    assert content is None and _pairs(calls) == [("add", {"a": 1, "b": 2})]


def test_required_schema_shape():
    tools = plan_tools(TOOLS, "required").tools
    schema = required_schema(tools, parallel_tool_calls=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "add"}]
    good = [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"city": "x"}}], schema)
    assert "maxItems" not in required_schema(tools, parallel_tool_calls=True)


def _accepts(grammar: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar, text)


_ANSWER = StructuredOutput(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                        "required": ["ok"], "additionalProperties": False})
_CALLS = st.one_of(
    st.fixed_dictionaries({"name": st.just("add"), "arguments": st.fixed_dictionaries(
        {"a": st.integers(0, 99), "b": st.integers(0, 99)})}),
    st.fixed_dictionaries({"name": st.just("get_weather"), "arguments": st.fixed_dictionaries(
        # xgrammar 0.2.9 writes strings with maxLength without escapes, so none that needs one
        {"city": st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters='"\\'),
                         max_size=10),
         "days": st.integers(1, 7)})}))


def _block(call: dict) -> str:
    """A call as the grammar writes it: "name" first, the arguments in the schema's order (alphabetical here)."""
    arguments = json.dumps(call["arguments"], separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return f'<tool_call>\n{{"name":{json.dumps(call["name"])},"arguments":{arguments}}}\n</tool_call>'


@settings(max_examples=40, deadline=None)
@given(calls=st.lists(_CALLS, min_size=1, max_size=3), ok=st.booleans())
def test_calls_or_answer_grammar(calls, ok):
    """auto + an answer format: one or more call blocks (one without parallel calls) or the answer, nothing else."""
    parallel = calls_or_answer(plan_tools(TOOLS), _ANSWER, answer_param="response_format").grammar
    single = calls_or_answer(plan_tools(TOOLS, parallel_tool_calls=False), _ANSWER,
                             answer_param="response_format").grammar
    blocks = "\n".join(_block(c) for c in calls)
    assert _accepts(parallel, blocks)
    assert _accepts(single, blocks) == (len(calls) == 1)
    answer = json.dumps({"ok": ok}, separators=(",", ":"))
    assert _accepts(parallel, answer) and _accepts(single, answer)
    for wrong in ("Sure. " + blocks, blocks + answer, answer + "\n" + blocks, _block({"name": "nope", "arguments": {}}),
                  _block({**calls[0], "arguments": {**calls[0]["arguments"], "extra": 1}}), '{"ok":"yes"}'):
        assert not _accepts(parallel, wrong), wrong


def test_calls_or_answer_errors_name_the_field():
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}}}]
    with pytest.raises(InvalidRequestError) as err:
        calls_or_answer(plan_tools(bad_tool), _ANSWER, answer_param="response_format")
    assert err.value.param == "tools[0].function.parameters"
    with pytest.raises(InvalidRequestError) as err:
        calls_or_answer(plan_tools(TOOLS), StructuredOutput(grammar="root ::= nowhere"), answer_param="guided_grammar")
    assert err.value.param == "guided_grammar"


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters"),
    ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "</tool_call>"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 'say "hi"'}}], None, "tools[0].function.name"),
    ("f", None, "tools"),
])
def test_plan_errors_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as err:
        plan_tools(tools, choice)
    assert err.value.param == param


def test_plan_defaults():
    assert plan_tools(None, None) is None and plan_tools([], "none") is None
    plan = plan_tools(TOOLS)
    assert plan.mode == "auto" and plan.structured_output is None
    assert plan_tools(TOOLS, "required").structured_output.kind == "json_schema"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.structured_output == StructuredOutput(json_schema=ADD)
    assert named.constraint_param == "tools[1].function.parameters"


# ---------------------------------------------------------------------------- rendering
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(extract_builtin_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_template_with_tool_support(tokenizer):
    assert template_supports_tools(TOOL_TEMPLATE)
    renderer = ChatRenderer(tokenizer)
    plan = plan_tools(TOOLS)
    text = renderer.render(CONVERSATION, plan.tools, chat_template=TOOL_TEMPLATE)
    assert "Tools:\n" in text and '"name": "get_weather"' in text
    # the call's JSON-text arguments reached the template as a dict, so tojson wrote an object
    assert '"arguments": {"city": "Paris", "days": 2}' in text
    assert "<tool_response>\nsunny, 22 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert TOOLS_PREAMBLE.splitlines()[0] not in text  # no fallback


def test_fallback_for_template_without_tools(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)  # the built-in model's template
    renderer = ChatRenderer(tokenizer)
    plan = plan_tools(TOOLS)
    text = renderer.render(CONVERSATION, plan.tools)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help.\n\n# Tools")  # appended to the system message
    for tool in TOOLS:
        assert json.dumps(tool) in system
    assert "<tool_call>" in system and "</tool_call>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' \
        "\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 22 C\n</tool_response><|im_end|>" in text
    # consecutive results share one user turn; without a system message the preamble is a new one
    two = [CONVERSATION[1], CONVERSATION[2], CONVERSATION[3], {"role": "tool", "content": "rain"}]
    text = renderer.render(two, plan.tools)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "<tool_response>\nsunny, 22 C\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    # without tools, tool messages are still rendered through the fallback
    assert "<tool_response>" in renderer.render(CONVERSATION)


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "messages[1].role"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0].function.name"),
])
def test_render_errors(tokenizer, messages, param):
    with pytest.raises(InvalidRequestError) as err:
        ChatRenderer(tokenizer).render(messages)
    assert err.value.param == param


# ---------------------------------------------------------------------------- InferenceEngine.chat
@pytest.fixture(scope="module")
def engine():
    with InferenceEngine(EngineConfig(max_batch_size=4, batch_timeout_ms=1)) as e:
        yield e


def test_engine_chat_required_and_named(engine):
    messages = [{"role": "user", "content": "Add 2 and 3"}]
    r = engine.chat(messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_new_tokens=120,
                    temperature=0)
    assert isinstance(r, ChatResult) and r.finish_reason == "tool_calls" and r.content is None
    (call,) = r.tool_calls
    jsonschema.validate(call.parsed_arguments(), {t["function"]["name"]: t["function"]["parameters"]
                                                  for t in TOOLS}[call.name])
    r = engine.chat(messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                    max_new_tokens=60, temperature=1.0, seed=3)
    (call,) = r.tool_calls
    assert call.name == "add" and r.text == call.arguments
    jsonschema.validate(call.parsed_arguments(), ADD)
    assert r.stats.completion_tokens >= 1


def test_engine_chat_auto_with_a_format(engine):
    """engine.chat as the server: auto + structured_output gives calls when the model's first choice opens
    one (a logit_bias on ``<`` here), an answer in the format otherwise."""
    opening = engine.tokenizer.convert_tokens_to_ids("<")
    for bias in ({opening: 100.0}, None):
        r = engine.chat([{"role": "user", "content": "Add 2 and 3"}], tools=TOOLS, parallel_tool_calls=False,
                        structured_output=_ANSWER, max_new_tokens=200, temperature=1.0, seed=3, logit_bias=bias)
        if bias:
            (call,) = r.tool_calls
            assert r.finish_reason == "tool_calls" and call.name in {"add", "get_weather"}
        else:
            assert r.tool_calls == () and set(json.loads(r.content)) == {"ok"}


def test_call_or_answer_follows_the_first_choice():
    """The processor: at the first token, the call opening stays alone when it is the most likely token,
    and is banned otherwise; later tokens are untouched."""
    from llminfer.sampling.processors import CallOrAnswer, RequestHistory

    class Params:
        structured_output = StructuredOutput(grammar='root ::= "a"', call_opening_ids=(1, 3))

    history = RequestHistory()
    history.token_ids, history.num_prompt = [7, 8], 2
    proc = CallOrAnswer.for_request(Params(), history, {"device": "cpu"})
    row = torch.tensor([0.0, 5.0, 1.0, 2.0, 4.0])
    proc(row, history)
    assert row.tolist() == [float("-inf"), 5.0, float("-inf"), 2.0, float("-inf")]
    row = torch.tensor([0.0, 3.0, 1.0, 2.0, 4.0])
    proc(row, history)
    assert row.tolist() == [0.0, float("-inf"), 1.0, float("-inf"), 4.0]
    history.token_ids.append(4)
    row = torch.tensor([0.0, 5.0, 1.0, 2.0, 4.0])
    proc(row, history)
    assert row.tolist() == [0.0, 5.0, 1.0, 2.0, 4.0]


def test_call_opening_ids_on_the_builtin_tokenizer(tokenizer):
    from llminfer.tools.answer_format import call_opening_ids

    ids = call_opening_ids(tokenizer)
    texts = [tokenizer.decode([i]) for i in ids]
    assert "<" in texts and all("<tool_call>\n".startswith(t) or t.startswith("<tool_call>") for t in texts)


def test_engine_chat_plain_and_errors(engine):
    messages = [{"role": "user", "content": "Hi"}]
    r = engine.chat(messages, max_new_tokens=5, temperature=0, ignore_eos=True)
    assert r.content == r.text == engine.run(ChatRenderer(engine.tokenizer).render(messages), max_new_tokens=5,
                                             temperature=0, ignore_eos=True).generated_text
    assert r.tool_calls == () and r.finish_reason == "length"
    with pytest.raises(InvalidRequestError) as err:
        engine.chat(messages, tools=TOOLS, tool_choice="required",
                    structured_output=StructuredOutput(json_object=True))
    assert err.value.param == "structured_output"
    with pytest.raises(InvalidRequestError) as err:
        engine.chat(messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}})
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as err:
        engine.chat([{"role": "bot", "content": "x"}])
    assert err.value.param == "messages[0].role"
