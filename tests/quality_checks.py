"""Content checks of tool calls and structured output on a trained model, shared by
tests/test_quality_trained.py and bench/bench_quality.py. The cases live in tests/data/quality/ (written for
llminfer). Each check goes through the HTTP API with the official ``openai`` client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "quality"
TOOLS = json.loads((DATA / "tool_calls.json").read_text())
CAPITALS = json.loads((DATA / "capitals.json").read_text())
SYSTEM = "You are a helpful assistant with access to tools. When a tool can answer the question, call it."


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(value, (int, float)) and float(value) == float(want)
    return isinstance(value, str) and value.strip().casefold() == str(want).casefold()


def call_fits(call: Any, case: dict[str, Any]) -> bool:
    """Whether an openai ``tool_call`` names the case's tool with arguments equal to the expected ones
    (strings compared without case, numbers by value; extra arguments are wrong)."""
    if call.function.name != case["tool"]:
        return False
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return False
    return set(args) == set(case["arguments"]) and all(_same(args[k], v) for k, v in case["arguments"].items())


def tool_call_results(client: Any, model: str) -> dict[str, list[dict[str, Any]]]:
    """Every case of tool_calls.json under ``tool_choice`` auto, required and named (greedy, one call
    at most): per mode, per case, the calls made (name, arguments), the text, and whether the calls fit."""
    out: dict[str, list[dict[str, Any]]] = {"auto": [], "required": [], "named": []}
    for case in TOOLS["cases"]:
        named = {"type": "function", "function": {"name": case["tool"]}}
        for mode, choice in (("auto", "auto"), ("required", "required"), ("named", named)):
            r = client.chat.completions.create(
                model=model, messages=[{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": case["question"]}],
                tools=TOOLS["tools"], tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=120)
            message = r.choices[0].message
            calls = message.tool_calls or []
            out[mode].append({"question": case["question"], "finish_reason": r.choices[0].finish_reason,
                              "calls": [(c.function.name, c.function.arguments) for c in calls],
                              "content": message.content, "right": len(calls) == 1 and call_fits(calls[0], case)})
    return out


def capital_results(client: Any, model: str) -> list[dict[str, Any]]:
    """Every country of capitals.json answered under its JSON Schema (greedy): the text, whether it is a
    complete object of the schema, and whether its fields name the country and its capital."""
    import jsonschema

    out = []
    for case in CAPITALS["cases"]:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": CAPITALS["prompt"].format(country=case["country"])}],
            temperature=0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITALS["schema"]}})
        text = r.choices[0].message.content or ""
        try:
            value = json.loads(text)
            jsonschema.validate(value, CAPITALS["schema"])
            valid = r.choices[0].finish_reason == "stop"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            value, valid = {}, False
        out.append({"country": case["country"], "text": text, "valid": valid,
                    "country_right": valid and _same(value["country"], case["country"]),
                    "capital_right": valid and _same(value["capital"], case["capital"])})
    return out
