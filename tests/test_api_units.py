"""Unit tests of the server's pure parts: prompt building (one BOS), token bytes, body validation and the
mapping of engine errors to OpenAI errors. No server, no model."""

from __future__ import annotations

import pytest

from llminfer.api import protocol as s
from llminfer.api.errors import APIError, from_engine_error
from llminfer.api.logprobs import TokenText
from llminfer.api.sampling import sampling_kwargs
from llminfer.api.translate import PromptBuilder, max_new_tokens
from llminfer.errors import CapacityError, EngineError, InvalidRequestError, RequestAbortedError
from llminfer.frontend.input import InputProcessor


class CharTokenizer:
    """One token per character (ids = code points + 10); ``<s>`` is BOS (id 1) and is added by encode()."""

    bos_token_id = 1
    chat_template = "{{ bos_token }}..."

    def __init__(self, template_has_bos: bool = True, adds_bos: bool = True) -> None:
        self.template_has_bos = template_has_bos
        self.adds_bos_default = adds_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        while text:
            if text.startswith("<s>"):
                ids.append(1)
                text = text[3:]
            else:
                ids.append(ord(text[0]) + 10)
                text = text[1:]
        return ([1] if add_special_tokens and self.adds_bos_default else []) + ids

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False):
        body = "".join(f"[{m['role']}]{m['content']}" for m in conversation) + ("[assistant]" if add_generation_prompt
                                                                               else "")
        return ("<s>" if self.template_has_bos else "") + body


@pytest.mark.parametrize(("template_has_bos", "adds_bos"), [(True, True), (False, True), (True, False)])
def test_chat_prompt_has_exactly_one_bos(template_has_bos, adds_bos):
    builder = PromptBuilder(CharTokenizer(template_has_bos, adds_bos), vocab_size=None)
    ids = builder.chat([s.ChatMessage(role="user", content="hi")])
    assert ids.count(1) == 1 and ids[0] == 1
    assert ids[1:] == CharTokenizer().encode("[user]hi[assistant]", add_special_tokens=False)


def test_chat_prompt_without_bos_model():
    tok = CharTokenizer(template_has_bos=False, adds_bos=False)
    tok.bos_token_id = None
    assert 1 not in PromptBuilder(tok, None).chat([s.ChatMessage(role="user", content="hi")])


def test_chat_content_parts_and_roles():
    builder = PromptBuilder(CharTokenizer(), None)
    parts = [s.ContentPart(type="text", text="a"), s.ContentPart(type="text", text="b")]
    assert builder.chat([s.ChatMessage(role="developer", content=parts)]) == \
        builder.chat([s.ChatMessage(role="system", content="a\nb")])
    with pytest.raises(APIError) as err:
        builder.chat([s.ChatMessage(role="user", content="x"),
                      s.ChatMessage(role="user", content=[s.ContentPart(type="image_url")])])
    assert err.value.status == 400 and err.value.param == "messages[1].content[0].type"


def test_completion_prompt_forms():
    builder = PromptBuilder(CharTokenizer(adds_bos=False), vocab_size=100)
    assert builder.completion("ab") == [[ord("a") + 10, ord("b") + 10]]
    assert builder.completion(["a", "b"]) == [[107], [108]]
    assert builder.completion([5, 6]) == [[5, 6]]
    assert builder.completion([[5], [6, 7]]) == [[5], [6, 7]]
    for bad, param in (([5, "a"], "prompt"), ([[5], []], "prompt[1]"), ([500], "prompt"), ("", "prompt")):
        with pytest.raises(APIError) as err:
            builder.completion(bad)
        assert err.value.status == 400 and err.value.param == param


def test_context_checks():
    inputs = InputProcessor(CharTokenizer(), 16)
    inputs.check_prompt_ids([5] * 10, max_new_tokens=5, param="messages")
    inputs.check_prompt_ids([5] * 10, param="messages")
    for prompt_len, max_new in ((16, None), (10, 7)):
        with pytest.raises(InvalidRequestError) as err:
            inputs.check_prompt_ids([5] * prompt_len, max_new_tokens=max_new, param="messages")
        api = from_engine_error(err.value, prompt_param="messages")
        assert api.code == "context_length_exceeded" and api.param == "messages"


def test_token_text_bytes_of_partial_characters():
    from transformers import AutoTokenizer

    from llminfer.models import builtin_model_path

    tok = AutoTokenizer.from_pretrained(str(builtin_model_path()))
    text = TokenText(tok)
    assert text.byte_level
    ids = tok.encode("日本語 🎉", add_special_tokens=False)
    raw = b"".join(bytes(text.lookup(i)[1]) for i in ids)
    assert raw.decode("utf-8") == "日本語 🎉"


def test_parse_body_names_the_field():
    with pytest.raises(APIError) as err:
        s.parse_body({"messages": [{"role": "user", "content": "x"}], "n": "2"}, s.ChatCompletionRequest)
    assert err.value.param == "n"
    with pytest.raises(APIError) as err:
        s.parse_body({"messages": [{"content": "x"}]}, s.ChatCompletionRequest)
    assert err.value.param == "messages[0].role" and err.value.code == "missing_required_parameter"
    with pytest.raises(APIError) as err:
        s.parse_body([1], s.ChatCompletionRequest)
    assert err.value.param is None and err.value.status == 400
    body = s.parse_body({"prompt": "x", "max_tokens": None}, s.CompletionRequest)
    assert max_new_tokens(body, 16) == (None, "max_tokens")
    assert max_new_tokens(s.parse_body({"prompt": "x"}, s.CompletionRequest), 16) == (16, "max_tokens")
    both = s.parse_body({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 5}, s.CompletionRequest)
    assert max_new_tokens(both, 16) == (5, "max_completion_tokens")
    # a null beside a number is an unset field (SDKs send every field): it does not lift the other's limit
    for fields in ({"max_tokens": 4, "max_completion_tokens": None}, {"max_tokens": None, "max_completion_tokens": 4}):
        body = s.parse_body({"messages": [{"role": "user", "content": "x"}], **fields}, s.ChatCompletionRequest)
        assert max_new_tokens(body, 16)[0] == 4
    nulls = s.parse_body({"prompt": "x", "max_tokens": None, "max_completion_tokens": None}, s.CompletionRequest)
    assert max_new_tokens(nulls, 16)[0] is None


def test_sampling_kwargs_defaults_and_extras():
    body = s.parse_body({"prompt": "x"}, s.CompletionRequest)
    assert sampling_kwargs(body, max_new_tokens=16) == {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}
    body = s.parse_body({"prompt": "x", "stop": "END", "top_k": -1, "seed": 3, "presence_penalty": 0.5,
                         "bad_words": ["a"], "ignore_eos": True}, s.CompletionRequest)
    kw = sampling_kwargs(body, max_new_tokens=4, logprobs=2)
    assert kw["stop_sequences"] == ["END"] and kw["top_k"] == 0 and kw["seed"] == 3
    assert kw["presence_penalty"] == 0.5 and kw["bad_words"] == ("a",) and kw["ignore_eos"] and kw["logprobs"] == 2
    assert kw.keys() == {"max_new_tokens", "temperature", "top_p", "stop_sequences", "top_k", "seed",
                         "presence_penalty", "bad_words", "ignore_eos", "logprobs"}
    tiny = s.parse_body({"prompt": "x", "temperature": 1e-6, "min_tokens": 2, "logit_bias": {"5": 1}},
                        s.CompletionRequest)
    kw = sampling_kwargs(tiny, max_new_tokens=4)
    assert kw["temperature"] == 0.0 and kw["min_new_tokens"] == 2 and kw["logit_bias"] == {5: 1.0}


def test_one_builder_serves_every_route_and_follows_sampling_params_fields():
    from llminfer.api.responses import ResponsesRequest

    extras = {"top_k": 3, "min_p": 0.1, "epsilon_cutoff": 0.02}
    for body in (s.parse_body({"prompt": "x", **extras}, s.CompletionRequest),
                 s.parse_body({"messages": [{"role": "user", "content": "x"}], **extras}, s.ChatCompletionRequest),
                 s.parse_body({"input": "x", "top_k": 3, "min_p": 0.1}, ResponsesRequest)):  # a subset of extras
        kw = sampling_kwargs(body, max_new_tokens=8)
        assert {k: kw[k] for k in extras if k in kw} == {k: v for k, v in extras.items() if hasattr(body, k)}


def test_engine_errors_map_to_openai_errors():
    # Mapped by type, param and code, never by the message: rewording a message changes nothing but the text.
    for text in ("whatever text", "a reworded message about the context"):
        e = from_engine_error(InvalidRequestError(text, param="temperature"))
        assert (e.status, e.param, e.code, e.message) == (400, "temperature", "invalid_value", text)
        e = from_engine_error(InvalidRequestError(text, param="prompt", code="context_length_exceeded"))
        assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
        e = from_engine_error(InvalidRequestError(text, param="prompt", code="context_length_exceeded"),
                              prompt_param="messages")
        assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
        e = from_engine_error(CapacityError(text), prompt_param="messages")
        assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
        e = from_engine_error(InvalidRequestError(text))
        assert (e.status, e.param, e.code) == (400, None, "invalid_value")
    # Engine field names become the OpenAI ones.
    for engine_name, api_name in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
                                  ("stop_sequences", "stop"), ("stop_token_ids", "stop_token_ids"), ("top_k", "top_k"),
                                  ("prompt[1]", "prompt[1]")):
        assert from_engine_error(InvalidRequestError("x", param=engine_name)).param == api_name
    e = from_engine_error(InvalidRequestError("unknown sampling argument 'typical_p'", param="typical_p",
                                              code="unsupported_parameter"))
    assert (e.status, e.param, e.code) == (400, "typical_p", "unsupported_parameter")
    assert e.message == "'typical_p' is not supported by this server's engine"
    # A message that once steered the old text matching no longer does.
    e = from_engine_error(InvalidRequestError("unknown sampling argument: context", param="seed"))
    assert (e.param, e.code) == ("seed", "invalid_value")
    assert from_engine_error(EngineError("backend step failed")).status == 500
    assert from_engine_error(RequestAbortedError("the engine shut down")).status == 503


def test_the_request_schema_imports_without_the_engine():
    import subprocess
    import sys

    code = ("import sys, llminfer.api.protocol, llminfer.api; "
            "print(sorted(m for m in ('torch', 'llminfer.engine', 'llminfer.api.app') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
