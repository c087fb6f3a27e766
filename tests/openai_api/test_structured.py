"""Structured output and tool calls over the OpenAI-compatible HTTP API of the embedded
deployment, through the official ``openai`` client: ``parse()`` with a pydantic model, 64
concurrent ``json_schema`` requests that all validate and equal their outputs without
speculation, ``tools`` with ``tool_choice`` required / named / auto, streamed calls, and 400s
with the reason for what cannot be served."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "kind": {"enum": ["beach", "city", "mountains"]}},
    "required": ["city", "days", "kind"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
OFF = {"speculation": {"mode": "off"}}


class Trip(BaseModel):
    city: str = Field(max_length=20)
    days: int = Field(ge=1, le=14)
    kind: Literal["beach", "city", "mountains"]


@pytest.fixture(scope="module")
def client(serving) -> openai.OpenAI:
    assert serving.router.http_port, "the embedded router serves no HTTP API"
    return openai.OpenAI(base_url=f"http://127.0.0.1:{serving.router.http_port}/v1",
                         api_key="-", max_retries=0, timeout=300)


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Plan trip number {i} as JSON."}]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model="target", messages=ask(0), max_tokens=96,
                                        temperature=0, response_format=Trip)
    msg = out.choices[0].message
    assert isinstance(msg.parsed, Trip) and out.choices[0].finish_reason == "stop"
    assert Trip.model_validate_json(msg.content) == msg.parsed


def test_64_concurrent_schema_requests_validate_and_equal_their_outputs_without_speculation(
        client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                  "strict": True}}

    def one(i: int, extra: dict | None) -> str:
        out = client.chat.completions.create(model="target", messages=ask(i), max_tokens=96,
                                             temperature=0, response_format=fmt,
                                             extra_body=extra)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        return out.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        auto = list(pool.map(lambda i: one(i, None), range(64)))
        off = list(pool.map(lambda i: one(i, OFF), range(64)))
    for text in auto:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert auto == off


def test_json_object_on_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(model="target", prompt="A record:", max_tokens=64,
                                    temperature=0, extra_body={"response_format":
                                                               {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":  # a long string may not close in 64 tokens
        assert isinstance(json.loads(out.choices[0].text), dict)
    assert out.choices[0].text.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_required_call_comes_back_as_tool_calls(client: openai.OpenAI, choice) -> None:
    out = client.chat.completions.create(model="target", messages=ask(1), max_tokens=64,
                                         temperature=0, tools=[WEATHER, TIME],
                                         tool_choice=choice)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_a_streamed_call_arrives_in_fragments_that_make_the_whole_call(
        client: openai.OpenAI) -> None:
    kw = dict(model="target", messages=ask(2), max_tokens=64, temperature=0, tools=[WEATHER],
              tool_choice="required")
    calls, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            assert not c.delta.content
            finish = c.finish_reason or finish
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    assert finish == "tool_calls" and len(calls) > 1 and {c.index for c in calls} == {0}
    assert calls[0].id.startswith("call_") and calls[0].function.name == whole.function.name
    assert "".join(c.function.arguments or "" for c in calls) == whole.function.arguments


def test_auto_leaves_a_text_reply_as_text(client: openai.OpenAI) -> None:
    kw = dict(model="target", messages=[{"role": "user", "content": "def load(path):\n"}],
              max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    out = client.chat.completions.create(tools=[WEATHER], **kw).choices[0]
    assert not plain.lstrip().startswith("{")
    assert out.message.tool_calls is None and out.message.content == plain


@pytest.mark.parametrize("extra, param, reason", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, None, "bogus"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format", "cannot both"),
])
def test_what_cannot_be_served_is_a_400_with_the_reason(client: openai.OpenAI, extra, param,
                                                         reason) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="target", messages=ask(3), max_tokens=8,
                                       extra_body=extra)
    assert reason in e.value.message
    if param:
        assert e.value.param == param


def test_tools_on_completions_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        client.completions.create(model="target", prompt="x", max_tokens=4,
                                  extra_body={"tools": [WEATHER]})
