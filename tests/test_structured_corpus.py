"""Structured output end to end on the built-in model (issue 13, "what it must show", engine side).

* The JSON Schema corpus (``tests/data/json_schemas/corpus.json``, 120 schemas): every schema run greedy,
  sampled (seeded, temperature 1) and streamed, at ``MAX_NEW_TOKENS``; every output parses and validates with
  ``jsonschema`` (formats checked), none ends on ``"length"``, and the streamed text equals the non-streamed
  text of the same seed. Constrained and unconstrained requests are submitted together, so they share
  batches, and the unconstrained ones must equal their solo outputs.
* Regex, choice and grammar constraints: every output is in the language, greedy and sampled.
* The mask against xgrammar's own matcher (hypothesis): at each step, the tokens llminfer's mask leaves
  finite are exactly those a fresh, independent ``xgrammar.GrammarMatcher`` accepts, and a random token
  sequence is accepted iff every step's mask allowed it.
* ``sample()`` directly: a constrained row does not change the unconstrained rows' tokens, and when bans
  (``min_new_tokens``, bad words) and the grammar leave no token, the grammar wins.

The model has random weights: the constraint alone makes the outputs valid, which is what is tested.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llminfer import EngineConfig, InferenceEngine
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.sampler import SamplingState, sample
from llminfer.sampling.structured import GrammarMatcher, StructuredOutput, allocate_bitmask, apply_bitmask

CORPUS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "json_schemas" / "corpus.json").read_text(encoding="utf-8"))

# Generous for the corpus: its longest output on the built-in model is ~160 tokens (greedy), and every string,
# array and number in it is bounded, so 0 outputs reach this (a "length" finish is a test failure).
MAX_NEW_TOKENS = 256
SEED = 1000  # request i is seeded SEED + i

# Unconstrained requests mixed into the constrained batches, compared with their solo outputs.
FREE_PROMPTS = ["The weather today", "def main():", "Once upon a time", "SELECT * FROM", "1, 2, 3,",
                "Dear team,", "import torch", "<html>"]
FREE_TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    eng = InferenceEngine(EngineConfig(device="cpu", dtype="float32")).load().start()
    # The tokenizer info and the compile server, before 120 constraints arrive at once with a 10 s deadline
    # (as the HTTP server does at start).
    eng.runtime.grammar_compiler.prepare().result(timeout=300)
    yield eng
    eng.close()


def _prompt(i: int) -> str:
    return f"Reply in JSON ({i}):"


def _so(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(json_schema=schema)


# xgrammar's "date" rule bounds the day at 31 whatever the month (sampling gave "4748-11-31"): the grammar
# guarantees the shape, not the calendar, so "date" is checked for the shape here; every other format as
# jsonschema checks it.
FORMATS = jsonschema.FormatChecker()
FORMATS.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
_DATE_SHAPE = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")


@FORMATS.checks("date")
def _date_shape(value: object) -> bool:
    return not isinstance(value, str) or _DATE_SHAPE.fullmatch(value) is not None


def _check_json(i: int, schema: dict[str, Any], result: Any) -> None:
    """Schema ``i``'s output parses, validates (formats included) and ended on the grammar, not the budget."""
    assert result.finish_reason == "stop", (i, result.finish_reason, result.generated_text[:200])
    assert len(result.token_ids) < MAX_NEW_TOKENS
    value = json.loads(result.generated_text)
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    errors = [e.message for e in validator.iter_errors(value)]
    assert not errors, (i, result.generated_text, errors)


def _features(node: Any, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        found.update(k for k in node if k in _WANTED)
        if node.get("additionalProperties") is False:
            found.add("additionalProperties:false")
        if node.get("type") in ("null", "boolean"):
            found.add(node["type"])
        if node.get("type") == "object" and set(node.get("properties", {})) - set(node.get("required", [])):
            found.add("optional property")
        for v in node.values():
            _features(v, found)
    elif isinstance(node, list):
        for v in node:
            _features(v, found)
    return found


_WANTED = {"anyOf", "oneOf", "$defs", "$ref", "enum", "const", "minItems", "maxItems", "minimum", "maximum",
           "exclusiveMinimum", "exclusiveMaximum", "pattern", "format", "maxLength", "minLength"}


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 100
    assert len({json.dumps(s, sort_keys=True) for s in CORPUS}) == len(CORPUS)  # no duplicates
    found = _features(CORPUS, set())
    missing = _WANTED | {"additionalProperties:false", "null", "boolean", "optional property"}
    assert not missing - found, missing - found
    formats = {n["format"] for n in _walk(CORPUS) if isinstance(n, dict) and "format" in n}
    assert {"date", "uuid", "ipv6", "date-time"} <= formats
    for schema in CORPUS:
        jsonschema.Draft202012Validator.check_schema(schema)


def _walk(node: Any):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_corpus_greedy_shares_batches_with_unconstrained(engine) -> None:
    solo = [engine.run(p, max_new_tokens=FREE_TOKENS, ignore_eos=True) for p in FREE_PROMPTS]
    constrained = [engine.make_request(_prompt(i), structured_output=_so(s), max_new_tokens=MAX_NEW_TOKENS)
                   for i, s in enumerate(CORPUS)]
    free = [engine.make_request(p, max_new_tokens=FREE_TOKENS, ignore_eos=True) for p in FREE_PROMPTS]
    # One free request after every constrained one at the head, so the first waves hold both kinds.
    mixed: list[Any] = []
    for k, req in enumerate(constrained):
        mixed.append(req)
        if k < len(free):
            mixed.append(free[k])
    results = dict(zip([r.request_id for r in mixed], engine.run_requests(mixed)))
    for i, (schema, req) in enumerate(zip(CORPUS, constrained)):
        _check_json(i, schema, results[req.request_id])
    for alone, req in zip(solo, free):
        together = results[req.request_id]
        assert together.token_ids == alone.token_ids
        assert together.finish_reason == "length"


@pytest.fixture(scope="module")
def sampled(engine) -> list[Any]:
    requests = [engine.make_request(_prompt(i), structured_output=_so(s), max_new_tokens=MAX_NEW_TOKENS,
                                    temperature=1.0, seed=SEED + i) for i, s in enumerate(CORPUS)]
    return engine.run_requests(requests)


def test_corpus_sampled(sampled) -> None:
    for i, (schema, result) in enumerate(zip(CORPUS, sampled)):
        _check_json(i, schema, result)
    # Sampling is sampling: the seeded outputs are not all one text.
    assert len({r.generated_text for r in sampled}) > len(CORPUS) // 2


@pytest.mark.slow
def test_corpus_streamed_equals_non_streamed(engine, sampled) -> None:
    def stream(i: int) -> tuple[str, tuple[int, ...], str | None]:
        text, ids, reason = [], [], None
        for chunk in engine.stream(_prompt(i), structured_output=_so(CORPUS[i]), max_new_tokens=MAX_NEW_TOKENS,
                                   temperature=1.0, seed=SEED + i):
            text.append(chunk.token)
            ids.extend(chunk.token_ids)
            if chunk.is_final:
                reason = chunk.finish_reason
        return "".join(text), tuple(ids), reason

    # Streams from threads run concurrently in the engine, so they share batches as served traffic does.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(stream, range(len(CORPUS))))
    for i, ((text, ids, reason), result) in enumerate(zip(streamed, sampled)):
        assert reason == result.finish_reason == "stop", i
        assert text == result.generated_text, i
        assert ids == result.token_ids, i


# --- regex, choice, grammar --------------------------------------------------------------------------------

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,10}@[a-z]{1,8}\.(com|net)",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
    r"(0|[1-9][0-9]{0,3})\.[0-9]{1,2}",
    r"#[0-9a-fA-F]{6}",
    r"[^\n\"]{1,12}",
    r"(ab|cd){1,5}",
    r"[α-ω]{2,5}",
    r"https?://[a-z]{1,10}\.(org|io)(/[a-z0-9]{1,6}){0,2}",
    r"x( y){0,3}!?",
]

CHOICES = [
    ["yes", "no"],
    ["café", "naïve", "日本語", "🙂 smile"],
    ['say "hi"', "it's", "back\\slash"],
    ["with spaces ", " leading", "a b c"],
    ["a", "ab", "abc"],
    ["line\nbreak", "tab\there"],
]

# Bounded (no unbounded recursion or repetition), so a random model cannot run away; each has an equivalent
# Python regex for a check independent of xgrammar.
GRAMMARS = [
    ('root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}',
     r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)"),
    ('root ::= pair (";" pair){0,2}\npair ::= key "=" val\nkey ::= [a-z]{1,4}\nval ::= "true" | "false" | [0-9]{1,3}',
     r"[a-z]{1,4}=(true|false|[0-9]{1,3})(;[a-z]{1,4}=(true|false|[0-9]{1,3})){0,2}"),
    ('root ::= "[" (item ("," item){0,2})? "]"\nitem ::= "x" | "[" ("x" ("," "x"){0,2})? "]"',
     r"\[((x|\[(x(,x){0,2})?\])(,(x|\[(x(,x){0,2})?\])){0,2})?\]"),
    ('root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi" | "hey"\nname ::= [A-Z] [a-z]{1,5}',
     r"(hello|hi|hey) [A-Z][a-z]{1,5}!"),
]

LANGUAGE_SEEDS = (None, 1, 2, 3)  # None = greedy


def _language_cases() -> list[tuple[StructuredOutput, Any]]:
    """(constraint, membership check on the output text)."""
    cases: list[tuple[StructuredOutput, Any]] = []
    for rx in REGEXES:
        cases.append((StructuredOutput(regex=rx), lambda t, rx=rx: re.fullmatch(rx, t) is not None))
    for choice in CHOICES:
        cases.append((StructuredOutput(choice=choice), lambda t, c=choice: t in c))
    for grammar, rx in GRAMMARS:
        cases.append((StructuredOutput(grammar=grammar), lambda t, rx=rx: re.fullmatch(rx, t) is not None))
    return cases


def test_regex_choice_grammar_outputs_are_in_the_language(engine) -> None:
    cases = _language_cases()
    requests, checks = [], []
    for k, (spec, check) in enumerate(cases):
        for seed in LANGUAGE_SEEDS:
            sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
            requests.append(engine.make_request(f"Answer ({k}):", structured_output=spec,
                                                max_new_tokens=MAX_NEW_TOKENS, **sampling))
            checks.append((spec, check, seed))
    compiler = engine.runtime.grammar_compiler
    texts: dict[int, set[str]] = {}
    for result, (spec, check, seed) in zip(engine.run_requests(requests), checks):
        assert result.finish_reason == "stop", (spec, seed, result.generated_text)
        assert check(result.generated_text), (spec, seed, result.generated_text)
        # xgrammar's own matcher, fresh: the token ids (with the stop token) are a complete sentence.
        ref = xgrammar.GrammarMatcher(compiler.compile(spec))
        assert all(ref.accept_token(t) for t in result.token_ids), (spec, seed)
        if not result.token_ids or result.token_ids[-1] not in compiler.stop_token_ids:
            assert ref.accept_token(compiler.stop_token_ids[0])
        assert ref.is_terminated(), (spec, seed)
        texts.setdefault(id(spec), set()).add(result.generated_text)
    # Sampling explores: most constraints gave more than one distinct output over the seeds.
    assert sum(len(v) > 1 for v in texts.values()) > len(cases) // 2


# --- the mask against xgrammar's own matcher -----------------------------------------------------------------

MASK_SPECS = [
    StructuredOutput(json_schema=CORPUS[22]),  # oneOf with const discriminators
    StructuredOutput(json_schema=CORPUS[23]),  # $defs / $ref
    StructuredOutput(json_schema=CORPUS[9]),  # bounded array of bounded strings
    StructuredOutput(regex=REGEXES[5]),
    StructuredOutput(choice=CHOICES[1]),
    StructuredOutput(grammar=GRAMMARS[0][0]),
]


def _llminfer_allowed(matcher: GrammarMatcher, vocab: int) -> torch.Tensor:
    """The token ids llminfer's mask leaves finite, through the sampler's own path (bitmask, then logits)."""
    bitmask = allocate_bitmask(2, vocab)
    matcher.fill_bitmask(bitmask, 1)  # row 1 of 2: the row index must be honoured
    logits = torch.zeros(2, vocab)
    apply_bitmask(logits, bitmask, [1])
    assert bool(torch.isfinite(logits[0]).all())  # the unconstrained row is untouched
    return torch.isfinite(logits[1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mask_equals_xgrammar_matcher(engine, data) -> None:
    compiler = engine.runtime.grammar_compiler
    vocab = engine.vocab_size
    stop = compiler.stop_token_ids
    spec = data.draw(st.sampled_from(MASK_SPECS))
    compiled = compiler.compile(spec)
    ours = GrammarMatcher(compiled)
    ref = xgrammar.GrammarMatcher(compiled)  # independent: its own state, fed the same prefix
    rng = data.draw(st.randoms(use_true_random=False))
    sequence: list[int] = []
    all_allowed = True
    for _ in range(data.draw(st.integers(1, 16))):
        finite = _llminfer_allowed(ours, vocab)
        allowed = torch.nonzero(finite).flatten().tolist()
        banned = torch.nonzero(~finite).flatten().tolist()
        assert allowed
        probe = set(stop) | set(rng.sample(allowed, min(64, len(allowed))))
        probe |= set(rng.sample(banned, min(64, len(banned))))
        for token in sorted(probe):
            accepted = ref.accept_token(token)
            assert accepted == bool(finite[token]), (spec, sequence, token)
            if accepted:
                ref.rollback(1)
        take_banned = banned and data.draw(st.booleans().map(lambda b: b and rng.random() < 0.3))
        token = rng.choice(banned if take_banned else allowed)
        sequence.append(token)
        if take_banned:
            assert not ours.accept(token)
            all_allowed = False
            break
        assert ours.accept(token) and ref.accept_token(token)
        if ours.terminated:
            assert token in stop and ref.is_terminated()
            break
    fresh = xgrammar.GrammarMatcher(compiled)
    assert all(fresh.accept_token(t) for t in sequence) == all_allowed, (spec, sequence)


# --- sample() directly ------------------------------------------------------------------------------------------

def _state(params: SamplingParams, grammar: Any = None, eos: tuple[int, ...] = (), bad: tuple = ()) -> SamplingState:
    return SamplingState(params, "cpu", [1, 2, 3], bad_words_ids=bad, eos_token_ids=eos, grammar=grammar)


def test_sample_constrained_row_leaves_unconstrained_rows_unchanged(engine) -> None:
    compiler = engine.runtime.grammar_compiler
    vocab, eos = engine.vocab_size, tuple(compiler.stop_token_ids)
    free = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5),
            SamplingParams(max_new_tokens=8, temperature=0.7, repetition_penalty=1.3, seed=6)]
    spec = StructuredOutput(json_schema=CORPUS[25])

    def run(with_constrained: bool) -> tuple[list[list[int]], list[int]]:
        states = [_state(p, eos=eos) for p in free]
        grammar_states = []
        if with_constrained:  # constrained rows interleaved: greedy and seeded sampled
            grammar_states = [_state(SamplingParams(max_new_tokens=8), compiler.compile(spec), eos),
                              _state(SamplingParams(max_new_tokens=8, temperature=1.0, seed=7),
                                     compiler.compile(spec), eos)]
            states = [states[0], grammar_states[0], states[1], grammar_states[1], states[2]]
        gen = torch.Generator().manual_seed(0)
        free_tokens: list[list[int]] = []
        constrained_tokens: list[int] = []
        for _ in range(6):
            logits = torch.randn(len(free), vocab, generator=gen)
            if with_constrained:
                logits = torch.cat([logits[:1], torch.randn(1, vocab), logits[1:2], torch.randn(1, vocab),
                                    logits[2:]])
            tokens, _ = sample(logits, states)
            free_tokens.append([tokens[0], tokens[2], tokens[4]] if with_constrained else tokens)
            if with_constrained:
                constrained_tokens += [tokens[1], tokens[3]]
        return free_tokens, constrained_tokens

    alone, _ = run(False)
    together, constrained = run(True)
    assert together == alone
    # And the constrained rows did follow their grammar: a fresh matcher accepts their tokens.
    for row in (0, 1):
        ref = xgrammar.GrammarMatcher(compiler.compile(spec))
        assert all(ref.accept_token(t) for t in constrained[row::2])


def _single_token(engine, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _favour(vocab: int, token: int) -> torch.Tensor:
    """Logits ``[1, V]`` where ``token`` is by far the most likely (so only a mask can stop it)."""
    logits = torch.zeros(1, vocab)
    logits[0, token] = 50.0
    return logits


def test_grammar_wins_over_min_new_tokens(engine) -> None:
    compiler = engine.runtime.grammar_compiler
    vocab, eos = engine.vocab_size, tuple(compiler.stop_token_ids)
    state = _state(SamplingParams(max_new_tokens=8, min_new_tokens=6), compiler.compile(StructuredOutput(
        choice=["yes"])), eos)
    other = _single_token(engine, "no")
    tokens = []
    for _ in range(5):  # "yes" takes at most 3 tokens, then EOS: all before min_new_tokens
        tokens += sample(_favour(vocab, other), [state])[0]  # the grammar overrides the logits
        if tokens[-1] in eos:
            break
    # Complete: only EOS is allowed, and min_new_tokens bans it; the grammar wins, so the output ends.
    assert tokens[-1] in eos and len(tokens) < 6
    assert engine.tokenizer.decode(tokens[:-1]) == "yes"
    assert state.grammar is not None and state.grammar.terminated


def test_grammar_wins_over_bad_words_only_when_nothing_else_is_left(engine) -> None:
    compiler = engine.runtime.grammar_compiler
    vocab, eos = engine.vocab_size, tuple(compiler.stop_token_ids)
    a, b = _single_token(engine, "a"), _single_token(engine, "b")
    params = SamplingParams(max_new_tokens=4, bad_words=("a",))
    # Bans and grammar leave one token ("b"): the ban holds even though "a" is far more likely.
    both = _state(params, compiler.compile(StructuredOutput(regex="a|b")), eos, bad=((a,),))
    assert sample(_favour(vocab, a), [both])[0] == [b]
    # Bans and grammar leave nothing: the grammar wins, and an unconstrained row next to it keeps its ban.
    only_a = _state(params, compiler.compile(StructuredOutput(regex="a")), eos, bad=((a,),))
    free = _state(params, eos=eos, bad=((a,),))
    logits = torch.cat([_favour(vocab, a), _favour(vocab, a)])
    tokens, _ = sample(logits, [only_a, free])
    assert tokens[0] == a and tokens[1] != a
    assert sample(_favour(vocab, a), [only_a])[0][0] in eos


def test_bounded_json_strings_admit_no_raw_control_characters(engine) -> None:
    """Regression: xgrammar's rule for a string with maxLength let a raw tab into the JSON (greedy output of
    corpus schema 119 was ``..."level":"+\traw햑"}``, which ``json.loads`` rejects)."""
    compiler = engine.runtime.grammar_compiler
    vocab = engine.vocab_size
    matcher = GrammarMatcher(compiler.compile(StructuredOutput(json_schema={"type": "string", "maxLength": 5})))
    assert matcher.accept(_single_token(engine, '"'))
    allowed = _llminfer_allowed(matcher, vocab)
    tab, text = _single_token(engine, "\t"), _single_token(engine, "ab")
    assert not bool(allowed[tab]) and bool(allowed[text])
    # No allowed token holds a control character anywhere (a sample of the vocabulary, decoded).
    ids = torch.nonzero(allowed).flatten().tolist()
    for token in ids[:: max(1, len(ids) // 5000)]:
        assert not any(ord(ch) < 0x20 for ch in engine.tokenizer.decode([token])), token


# ---------------------------------------------------------------------------- real-world tool schemas (issue 36)
# tests/data/json_schemas/tools_corpus.json (written by make_tools_corpus.py next to it): what pydantic v2
# emits for nested models (generated with pydantic), zod-to-json-schema's shapes (draft-07, definitions,
# pointer references, tuples, intersections) and MCP-style tool lists (required names not under properties,
# empty and missing parameters). Every accepted entry is run with tool_choice "required" and named for each
# of its tools, sampled with two seeds: every call's arguments are a JSON object that validates against the
# tool's own parameters (formats checked). Refused entries are refused naming the tool and the keyword.
TOOLS_CORPUS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "json_schemas" / "tools_corpus.json").read_text(encoding="utf-8"))
TOOL_SEEDS = (7, 8)


def _tool_plans(entry: dict[str, Any]) -> list[Any]:
    from llminfer.tools import plan_tools

    names = [t["function"]["name"] for t in entry["tools"]]
    # One call per output: parallel calls are an unbounded array, which a random model fills to max_tokens.
    return [plan_tools(entry["tools"], "required", parallel_tool_calls=False)] + [
        plan_tools(entry["tools"], {"type": "function", "function": {"name": n}}) for n in names]


def test_tools_corpus_is_varied() -> None:
    sources = {e["source"].split(":")[0] for e in TOOLS_CORPUS}
    assert sources == {"pydantic", "zod", "mcp"} and len(TOOLS_CORPUS) >= 25
    assert sum(len(e["tools"]) for e in TOOLS_CORPUS) >= 30
    text = json.dumps(TOOLS_CORPUS)
    for feature in ('"$defs"', '"definitions"', '"#/properties/a"', '"discriminator"', '"allOf"',
                    '"$ref": "#/$defs/TreeNode"'):
        assert feature in text, feature


def test_tools_corpus_refusals_name_the_tool_and_keyword() -> None:
    from llminfer.errors import InvalidRequestError
    from llminfer.tools import plan_tools

    refused = [e for e in TOOLS_CORPUS if e["refused"]]
    assert len(refused) >= 3
    for entry in refused:
        for choice in ("required", {"type": "function", "function": {"name": entry["tools"][0]["function"]["name"]}}):
            with pytest.raises(InvalidRequestError) as err:
                plan_tools(entry["tools"], choice)
            assert err.value.param == "tools[0].function.parameters", entry["source"]
            assert f"'{entry['refused']}'" in str(err.value), (entry["source"], str(err.value))


def test_tools_corpus_calls_validate(engine) -> None:
    from llminfer.tools import parse_tool_calls

    jobs = []
    compiler = engine.runtime.grammar_compiler
    compiler.prepare().result(timeout=300)  # the tokenizer info: built once, outside any request's deadline
    for entry in TOOLS_CORPUS:
        if entry["refused"]:
            continue
        for plan in _tool_plans(entry):  # compiled one at a time first: ~100 at once would queue past 10 s
            compiler.compile(plan.structured_output)
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in entry["tools"]}
        for plan in _tool_plans(entry):
            for seed in TOOL_SEEDS:
                req = engine.make_request(f"Call a tool ({entry['source']}):",
                                          structured_output=plan.structured_output, max_new_tokens=MAX_NEW_TOKENS,
                                          temperature=1.0, seed=seed)
                jobs.append((entry["source"], plan, params, req))
    results = engine.run_requests([j[3] for j in jobs])
    for (source, plan, params, _), result in zip(jobs, results):
        assert result.finish_reason == "stop", (source, plan.mode, result.generated_text[:300])
        content, calls = parse_tool_calls(result.generated_text, plan)
        assert content is None and calls, (source, plan.mode, result.generated_text[:300])
        for call in calls:
            args = call.parsed_arguments()
            assert isinstance(args, dict), (source, call)
            validator = jsonschema.validators.validator_for(params[call.name], jsonschema.Draft202012Validator)
            errors = [e.message for e in validator(params[call.name], format_checker=FORMATS).iter_errors(args)]
            assert not errors, (source, plan.mode, call.arguments, errors)
    assert len(jobs) >= 100
