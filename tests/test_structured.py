"""Structured output in the engine: the constraint type, the compiler (cache, errors, time limit), the
scheduler waiting for a grammar, failure isolation, speculative decoding, the vLLM mapping and the CLI."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import threading

import jsonschema
import pydantic
import pytest

from helpers import make_engine
from llminfer import SamplingParams
from llminfer.backends.vllm import sampling_kwargs, structured_outputs_param
from llminfer.core.scheduler import Scheduler, SchedulerLimits
from llminfer.errors import InvalidRequestError
from llminfer.kv.manager import KVCacheManager
from llminfer.models import build_random_model
from llminfer.models.builtin import builtin_model_path
from llminfer.protocols.messages import TokenizedRequest
from llminfer.sampling.structured import (
    MAX_SCHEMA_DEPTH,
    GrammarCompiler,
    GrammarHandle,
    GrammarMatcher,
    StructuredOutput,
)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str
    age: int


# ---------------------------------------------------------------------------- the constraint type
def test_exactly_one_constraint():
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput()
    assert e.value.param == "structured_output"
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput(json_schema="{nope")
    with pytest.raises(InvalidRequestError, match="list of strings"):
        StructuredOutput(choice="yes")
    with pytest.raises(InvalidRequestError, match="non-empty"):
        StructuredOutput(choice=[])
    with pytest.raises(InvalidRequestError, match="only references inside"):  # xgrammar would ignore it
        StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}})
    StructuredOutput(json_schema={"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"})


def test_schema_forms_are_one_cache_key_and_keep_property_order():
    from_dict = StructuredOutput(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    from_text = StructuredOutput(json_schema='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert from_dict == from_text and hash(from_dict) == hash(from_text)
    assert list(json.loads(from_dict.json_schema)["properties"]) == ["b", "a"]  # generation order
    assert json.loads(StructuredOutput(json_schema=Person).json_schema)["required"] == ["name", "age"]


def test_sampling_params_refuse_combinations_that_break_the_constraint():
    so = StructuredOutput(json_object=True)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_output=so, ignore_eos=True)
    assert e.value.param == "ignore_eos"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_output=so, force_words=("x",))
    assert e.value.param == "force_words"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_output={"type": "object"})
    assert e.value.param == "structured_output"
    assert not SamplingParams(structured_output=so).speculation_allowed


# ---------------------------------------------------------------------------- the compiler
def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kwargs", [
    dict(choice=5), dict(choice={"a": 1}), dict(choice=iter(["a"])), dict(choice="ab"),
    dict(json_object="no"), dict(json_object=1),
    dict(json_schema=_nested(MAX_SCHEMA_DEPTH)),  # 65 levels: the items chain plus the innermost schema
    dict(json_schema=_nested(5000)),  # past Python's recursion limit for json.dumps
    dict(json_schema='{"items":' * 5000 + "{}" + "}" * 5000),  # past it for json.loads
    dict(json_schema={"enum": {1, 2}}),  # not JSON
])
def test_hostile_values_are_invalid_request_errors(kwargs):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(**kwargs)
    assert e.value.param == "structured_output"


def test_schema_depth_limit_allows_the_limit():
    assert StructuredOutput(json_schema=_nested(MAX_SCHEMA_DEPTH - 1)).json_schema


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_path())


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_compiler_caches_by_constraint_and_reports_errors_with_param(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        a = compiler.compile(StructuredOutput(json_schema=PERSON))
        b = compiler.compile(StructuredOutput(json_schema=json.dumps(PERSON)))
        assert a is b and len(compiler.compile_times_s) == 1
        for bad in (lambda: StructuredOutput(regex="("), lambda: StructuredOutput(grammar="root ::= undefined_rule"),
                    lambda: StructuredOutput(json_schema={"type": "objekt"})):  # refused before xgrammar
            with pytest.raises(InvalidRequestError) as e:
                compiler.compile(bad())
            assert e.value.param == "structured_output" and ".cc:" not in str(e.value)
        with pytest.raises(InvalidRequestError):  # a failed compile is retried, not served from the cache
            compiler.compile(StructuredOutput(regex="("))
        assert len(compiler.compile_times_s) == 1
    finally:
        compiler.close()


def test_compile_past_the_time_limit_fails_with_a_code(tokenizer):
    clock = FakeClock()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [], timeout_s=5.0, clock=clock)
    release = threading.Event()
    compiler._compile = lambda spec: release.wait()  # a compile that runs until released
    try:
        handle = compiler.submit(StructuredOutput(regex="a+"))
        assert not handle.ready()
        clock.now = 4.9
        assert not handle.ready()
        clock.now = 5.0
        assert handle.ready()
        with pytest.raises(InvalidRequestError) as e:
            handle.result()
        assert e.value.code == "grammar_compile_timeout" and "5 s" in str(e.value)
    finally:
        release.set()
        compiler.close()


def _blocking_compiler(tokenizer, slow: StructuredOutput, **kw) -> tuple[GrammarCompiler, threading.Event, list]:
    """A compiler whose compile of ``slow`` runs until released (like a pathological schema: a compile
    cannot be interrupted); other constraints compile at once. Returns it, the release event, and the
    constraints compiled so far. The compile of ``slow`` has started when this returns."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [], **kw)
    release, started = threading.Event(), threading.Event()
    compiled: list[StructuredOutput] = []

    def compile_(spec):
        if spec == slow:
            started.set()
            release.wait(60)
        compiled.append(spec)
        return f"compiled {spec.kind}"

    compiler._compile = compile_
    compiler.submit(slow)
    assert started.wait(60)
    return compiler, release, compiled


def test_a_slow_compile_does_not_hold_up_the_others(tokenizer):
    slow = StructuredOutput(regex="slow")
    compiler, release, _ = _blocking_compiler(tokenizer, slow)
    try:
        stuck = compiler.submit(slow)  # the same compile, from the cache
        later = [compiler.submit(StructuredOutput(choice=[f"c{i}"])) for i in range(3)]
        # Before the fix (one compile thread) these queued behind the stuck compile until they timed out.
        assert [h.future.result(timeout=60) for h in later] == ["compiled choice"] * 3
        assert not stuck.future.done()
    finally:
        release.set()
        compiler.close()


def test_a_compile_nobody_waits_for_any_more_is_skipped(tokenizer):
    clock = FakeClock()
    slow = StructuredOutput(regex="slow")
    compiler, release, compiled = _blocking_compiler(tokenizer, slow, timeout_s=5.0, clock=clock, max_workers=1)
    try:
        queued = compiler.submit(StructuredOutput(regex="queued"))  # waits for the only worker
        clock.now = 5.0  # its request has timed out
        release.set()
        with pytest.raises(InvalidRequestError) as e:
            queued.future.result(timeout=60)
        assert e.value.code == "grammar_compile_timeout" and e.value.param == "structured_output"
        assert compiled == [slow]  # the queued one never ran for nobody
        assert compiler.compile(StructuredOutput(regex="queued")) == "compiled regex"  # and is not cached
    finally:
        release.set()
        compiler.close()


def test_a_request_joining_a_queued_compile_extends_its_deadline(tokenizer):
    clock = FakeClock()
    slow = StructuredOutput(regex="slow")
    compiler, release, compiled = _blocking_compiler(tokenizer, slow, timeout_s=5.0, clock=clock, max_workers=1)
    try:
        spec = StructuredOutput(regex="queued")
        compiler.submit(spec)
        clock.now = 4.0
        joined = compiler.submit(spec)  # same compile, deadline 9
        clock.now = 6.0
        release.set()
        assert joined.future.result(timeout=60) == "compiled regex"
    finally:
        release.set()
        compiler.close()


def test_bounded_strings_admit_no_raw_control_characters(tokenizer):
    """xgrammar lets a raw tab (or NUL) into a string with maxLength: not JSON (found by attack: a streamed
    tool call's arguments failed json.loads)."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        compiled = compiler.compile(StructuredOutput(json_schema={"type": "string", "maxLength": 5}))
        for text, ok in (('"a\tb"', False), ('"a\x00b"', False), ('"a b"', True), ('"ab\u00e9"', True)):
            matcher = GrammarMatcher(compiled)
            ids = tokenizer.encode(text, add_special_tokens=False)
            accepted = all(matcher.accept(t) for t in ids) and matcher.accept(tokenizer.eos_token_id)
            assert accepted is ok, text
    finally:
        compiler.close()


# ---------------------------------------------------------------------------- the scheduler waits
def _request(rid: str, grammar: GrammarHandle | None = None) -> TokenizedRequest:
    return TokenizedRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=4), 0, grammar=grammar)


def test_scheduler_waits_for_a_grammar_and_fails_a_timed_out_one_alone():
    clock = FakeClock()
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=64), kv)
    pending: concurrent.futures.Future = concurrent.futures.Future()
    sched.add_request(_request("constrained", GrammarHandle(pending, 10.0, clock, 10.0)))
    sched.add_request(_request("plain"))
    plan, failures = sched.schedule()
    assert [s.request_id for s in plan.sequences] == ["plain"] and not failures
    assert sched.waiting_for_grammar
    clock.now = 10.0  # past the deadline, still not compiled
    plan, failures = sched.schedule()
    assert "constrained" not in [s.request_id for s in plan.sequences]
    assert [(u.request_id, u.finish_reason, u.error.code) for u in failures] == [
        ("constrained", "error", "grammar_compile_timeout")]
    assert "constrained" not in sched.requests and not sched.waiting_for_grammar
    sched.check_invariants()


def test_scheduler_hands_the_compiled_grammar_to_the_backend_once():
    clock = FakeClock()
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=64),
                      KVCacheManager(64, 4))
    done: concurrent.futures.Future = concurrent.futures.Future()
    sched.add_request(_request("r", GrammarHandle(done, 10.0, clock, 10.0)))
    assert not sched.schedule()[0].sequences
    done.set_result("compiled")
    plan, _ = sched.schedule()
    assert [n.grammar for n in plan.new_requests] == ["compiled"]


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine():
    with make_engine(builtin_model_path(), max_batch_size=8, block_size=4) as eng:
        yield eng


def test_each_kind_of_constraint_holds_greedy_and_sampled(engine):
    cases = [
        (StructuredOutput(json_schema=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutput(regex=r"[a-z]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
        (StructuredOutput(choice=["yes", "no", 'say "maybe"']), lambda t: t in ("yes", "no", 'say "maybe"')),
        (StructuredOutput(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'),
         lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
    ]
    for so, ok in cases:
        for temperature in (0.0, 1.0):
            results = engine.run_batch_continuous(["Answer:", "Q: why?\nA:"], structured_output=so,
                                                  max_new_tokens=200, temperature=temperature, seed=7)
            for r in results:
                if so.json_object and temperature and r.finish_reason == "length":
                    continue  # any JSON object has unbounded strings: a sampled one may run to the limit
                assert r.finish_reason == "stop", (so.kind, r.generated_text)
                assert ok(r.generated_text), (so.kind, r.generated_text)


def test_a_bad_constraint_fails_its_request_alone_and_leaks_nothing(engine):
    good = engine.make_request("Hello", max_new_tokens=8, ignore_eos=True)
    bad = engine.make_request("Hello", max_new_tokens=8, structured_output=StructuredOutput(regex="(ab"))
    constrained = engine.make_request("Hello", max_new_tokens=50, structured_output=StructuredOutput(choice=["x"]))
    with pytest.raises(InvalidRequestError) as e:
        engine.run(bad.prompt, max_new_tokens=8, structured_output=StructuredOutput(regex="(ab"))
    assert e.value.param == "structured_output"
    results = engine.run_requests([good, constrained])
    assert len(results[0].token_ids) == 8 and results[1].generated_text == "x"
    engine.wait_drained()
    stats = engine.cache_stats()
    assert stats["blocks_used"] == 0
    del bad


def test_a_constraint_that_matches_no_text_is_an_error_not_an_empty_answer(engine):
    # An empty language: refused when it compiles (no token can start it). A JSON string whose pattern matches
    # nothing: the opening quote is allowed, then no token; the request fails there instead of decoding masked
    # tokens to its length limit (it answered "" or '"' with a 200 before), and the others go on.
    for empty in (StructuredOutput(regex=r"[^\s\S]"), StructuredOutput(grammar="root ::= root")):
        with pytest.raises(InvalidRequestError, match="matches no text") as e:
            engine.run("Hello", max_new_tokens=8, structured_output=empty)
        assert e.value.param == "structured_output"
    dead_end = StructuredOutput(json_schema={"type": "string", "pattern": "[^\\s\\S]"})
    other = engine.make_request("Hello", max_new_tokens=6, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="allows no token after the text so far") as e:
        engine.run("Hello", max_new_tokens=8, structured_output=dead_end)
    assert e.value.param == "structured_output"
    assert len(engine.run_requests([other])[0].token_ids) == 6
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0


def test_a_constraint_under_an_openai_name_points_to_structured_output(engine):
    with pytest.raises(InvalidRequestError, match=r"structured_output=StructuredOutput") as e:
        engine.run("x", response_format={"type": "json_object"})
    assert e.value.param == "response_format" and e.value.code == "unsupported_parameter"


def test_stream_equals_run_under_a_constraint(engine):
    so = StructuredOutput(json_schema=PERSON)
    kw = dict(structured_output=so, max_new_tokens=120, temperature=1.0, seed=11)
    text = "".join(c.token for c in engine.stream("Person:", **kw))
    assert text == engine.run("Person:", **kw).generated_text


def test_speculative_decoding_serves_constrained_requests_without_drafts(qwen2_dir, tmp_path):
    draft = build_random_model(tmp_path / "draft", architecture="qwen2", hidden_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, intermediate_size=64, seed=9)
    with make_engine(qwen2_dir, block_size=4, assistant_model_name=str(draft), speculative_num_assistant_tokens=3,
                     speculative_confidence_threshold=0.0) as eng:
        free = eng.make_request("Hello there", max_new_tokens=12, ignore_eos=True)
        constrained = eng.make_request("Hello there", max_new_tokens=200,
                                       structured_output=StructuredOutput(json_schema=PERSON))
        free, constrained = eng.run_requests([free, constrained])  # one batch: drafts for one row only
        jsonschema.validate(json.loads(constrained.generated_text), PERSON)
        assert constrained.stats.spec_proposed_tokens == 0  # a constrained row never takes drafts
        assert free.stats.spec_proposed_tokens > 0 and len(free.token_ids) == 12


# ---------------------------------------------------------------------------- vLLM and the CLI
def test_vllm_gets_its_own_structured_outputs_fields():
    for so, fields in [
        (StructuredOutput(json_schema=PERSON), {"json": PERSON, "disable_any_whitespace": True}),
        (StructuredOutput(json_object=True), {"json_object": True, "disable_any_whitespace": True}),
        (StructuredOutput(regex="a+"), {"regex": "a+"}),
        (StructuredOutput(choice=["a", "b"]), {"choice": ["a", "b"]}),
        (StructuredOutput(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ]:
        assert sampling_kwargs(SamplingParams(structured_output=so))["structured_outputs"] == fields

    class New:
        class sampling_params:
            StructuredOutputsParams = dict

    class Old:
        class sampling_params:
            GuidedDecodingParams = dict

    assert structured_outputs_param(New, {"regex": "a"}) == {"structured_outputs": {"regex": "a"}}
    assert structured_outputs_param(Old, {"regex": "a"}) == {"guided_decoding": {"regex": "a"}}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llminfer.cli", *args, "--device", "cpu"], capture_output=True,
                          text=True, timeout=180)


def test_cli_json_schema_from_a_file_and_one_line_errors(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    p = _cli("run", "Person:", "--json-schema", f"@{path}", "--max-new-tokens", "120", "--json")
    assert p.returncode == 0, p.stderr
    jsonschema.validate(json.loads(json.loads(p.stdout)["generated_text"]), PERSON)
    # a usage error, exit 2, naming the flag (as every other bad flag)
    for args, needle in [(["--regex", "("], "--regex: invalid"),
                         (["--regex", "a", "--json-object"], "--json-object and --regex: give exactly one"),
                         (["--choice", "yes", "--json-object"], "--json-object and --choice"),
                         (["--json-schema", "@/no/such/file.json"], "cannot read")]:
        p = _cli("run", "x", *args)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], p.stderr


def test_special_token_text_is_generated_as_text_not_as_the_special_token(engine):
    # "<|endoftext|>" is also the name of a stop token: the choice must come out as text.
    for choice in (["<|endoftext|>"], ["<|im_end|>", "<|im_start|>x"]):
        for seed in range(3):
            r = engine.run("hi", structured_output=StructuredOutput(choice=choice), max_new_tokens=40,
                           temperature=1.0, seed=seed)
            assert r.generated_text in choice and r.finish_reason == "stop", r
            special = set(engine.tokenizer.all_special_ids)
            assert not special & set(r.token_ids[:-1])  # the last token is the real EOS


def test_the_mask_never_offers_a_special_token_for_its_text(tokenizer):
    from llminfer.sampling.structured import GrammarMatcher, allocate_bitmask, special_token_ids

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        matcher = GrammarMatcher(compiler.compile(StructuredOutput(choice=["<|endoftext|>", "<|im_end|>"])))
        bitmask = allocate_bitmask(1, len(tokenizer))
        matcher.fill_bitmask(bitmask, 0)
        allowed = {t for t in range(len(tokenizer)) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
        assert allowed and not allowed & special_token_ids(tokenizer)
    finally:
        compiler.close()


@pytest.mark.parametrize("args, needle", [
    (["--json-schema", '{"type": "nonsense"}'], "keyword 'type'"), (["--regex", "[a-"], "regex"),
    (["--grammar", "root ::="], "grammar"), (["--stop", ""], "--stop"), (["--stop", ","], "--stop"),
    (["--bad-words", ""], "--bad-words"), (["--force-words", ","], "--force-words")])
def test_cli_refuses_a_bad_constraint_or_stop_before_loading_the_model(monkeypatch, capsys, args, needle):
    import llminfer.cli.generate as generate
    from llminfer.cli import main

    def never(*_a, **_k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate, "load_engine", never)
    with pytest.raises(SystemExit) as code:
        main(["run", "x", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code.value.code not in (0, None) and len(err) == 1 and needle in err[0], err
