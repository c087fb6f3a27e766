"""A streamed call as OpenAI streams one (``CallStream``): with a required or named call, a
first delta with the id and name, then the arguments in fragments whose concatenation is the
arguments the whole reply gives; in ``auto`` the call held back and sent whole; text as text;
and several calls in one reply (``parallel_tool_calls``), each streamed with its index."""

from __future__ import annotations

import json

import pytest

from spin.openai_api import protocol as p
from spin.openai_api.structured import CallStream, grammar_of, tool_calls
from spin.router.accounting import StepInfo
from spin.router.streaming import Chunk

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Rome \\"}{\\" [x]", "days": [1, {"a": 2}]}}'


def body(choice: str | None) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(model="target", messages=[{"role": "user", "content": "hi"}],
                                   tools=[WEATHER], tool_choice=choice, stream=True)


def stream(choice: str | None, text: str, size: int, finish: str = "stop"
           ) -> list[tuple[dict, str | None]]:
    """The deltas ``CallStream`` sends for ``text`` generated ``size`` characters a step."""
    calls = CallStream(body(choice))
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    step = StepInfo("d", 2, 2, 1, 0.01, 0.0, 1)
    return [calls.delta(0, Chunk("r", [1], part, step, finish if i == len(parts) - 1 else None))
            for i, part in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_required_call_streams_its_id_and_name_then_its_arguments(size: int) -> None:
    out = stream("required", CALL, size)
    deltas = [d for d, _ in out if d]
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(d["content"] is None and len(d["tool_calls"]) == 1 for d in deltas)
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])  # once
    arguments = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    whole = tool_calls(body("required"), CALL)[0].function.arguments
    assert arguments == whole and json.loads(arguments) == json.loads(CALL)["arguments"]
    assert [f for _, f in out][-1] == "tool_calls" and all(f is None for _, f in out[:-1])
    if size == 1:  # fragments as they come, not the whole at the end
        assert len(deltas) > len(whole) // 2


def test_a_call_cut_short_streams_what_there_is_and_says_why() -> None:
    out = stream("required", CALL[:50], 4, finish="length")
    assert out[-1][1] == "length"
    arguments = "".join(d["tool_calls"][0]["function"].get("arguments", "")
                        for d, _ in out if d)
    assert arguments == CALL[CALL.index('{"city"'):50]
    early = stream("required", CALL[:10], 4, finish="length")  # no name yet: the text as is
    assert early[-1] == ({"content": CALL[:10]}, "length")


def test_a_call_whose_name_comes_after_its_arguments_goes_out_whole() -> None:
    text = '{"arguments": {"city": "Rome"}, "name": "get_weather"}'
    out = stream("required", text, 4)
    assert all(d == {} for d, _ in out[:-1])
    d, finish = out[-1]
    assert finish == "tool_calls" and d["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(d["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_auto_sends_a_call_whole_and_text_as_text() -> None:
    out = stream("auto", CALL, 5)
    assert all(d == {} for d, _ in out[:-1])
    d, finish = out[-1]
    assert finish == "tool_calls" and json.loads(d["tool_calls"][0]["function"]["arguments"]) \
        == json.loads(CALL)["arguments"]
    text = stream("auto", "Sunny in Rome.", 3)
    assert "".join(d["content"] for d, _ in text) == "Sunny in Rome."
    assert text[-1][1] == "stop"


# ---- several calls in one reply (parallel_tool_calls, OpenAI's default) -----------------------

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CALLS = ('[{"name":"get_weather","arguments":{"city":"Oslo, \\"N\\" {x}"}},'
         ' {"name": "get_time", "arguments": {"zone": "CET"}}]')


def several(choice: str | None, parallel: bool | None = None) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(model="target", messages=[{"role": "user", "content": "hi"}],
                                   tools=[WEATHER, TIME], tool_choice=choice, stream=True,
                                   parallel_tool_calls=parallel)


def stream_calls(b: p.ChatCompletionRequest, text: str, size: int) -> list[tuple[dict, str | None]]:
    calls = CallStream(b)
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    step = StepInfo("d", 2, 2, 1, 0.01, 0.0, 1)
    return [calls.delta(0, Chunk("r", [1], part, step, "stop" if i == len(parts) - 1 else None))
            for i, part in enumerate(parts)]


def test_an_array_of_calls_is_several_calls_unless_parallel_calls_are_off() -> None:
    calls = tool_calls(several("required"), CALLS)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": 'Oslo, "N" {x}'}, {"zone": "CET"}]
    assert calls[0].function.arguments == '{"city":"Oslo, \\"N\\" {x}"}'  # as written
    assert calls[0].id != calls[1].id
    assert tool_calls(several("required", parallel=False), CALLS) is None
    assert tool_calls(several("auto"), "[]") is None  # no call is not calls
    assert tool_calls(several("required"), '[{"name": "nope", "arguments": {}}]') is None


def test_the_grammar_allows_an_array_of_calls_only_where_several_may_be_made() -> None:
    def schema(choice: object, parallel: bool | None = None) -> dict:
        b = several(choice, parallel)
        return json.loads(grammar_of(b).source)

    one = schema("required", parallel=False)
    assert "anyOf" in one and all(v["type"] == "object" for v in one["anyOf"])  # two tools
    both = schema("required")
    assert both["anyOf"][0] == one
    assert both["anyOf"][1] == {"type": "array", "items": one, "minItems": 1}
    named = schema({"type": "function", "function": {"name": "get_time"}})
    assert named["properties"]["name"] == {"const": "get_time"}  # one call of it


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_required_calls_stream_each_with_its_index_id_name_and_arguments(size: int) -> None:
    out = stream_calls(several("required"), CALLS, size)
    deltas = [c for d, _ in out if d for c in d["tool_calls"]]
    whole = tool_calls(several("required"), CALLS)
    for i, call in enumerate(whole):
        mine = [c for c in deltas if c["index"] == i]
        assert [c["function"]["name"] for c in mine if "id" in c] == [call.function.name]
        assert "".join(c["function"].get("arguments", "") for c in mine) == call.function.arguments
    assert {c["index"] for c in deltas} == {0, 1} and out[-1][1] == "tool_calls"
    if size == 1:  # the first call streams before the second is written
        first_of_second = next(j for j, (d, _) in enumerate(out)
                               if d and any(c["index"] == 1 for c in d["tool_calls"]))
        assert any(d and d["tool_calls"][0]["index"] == 0 for d, _ in out[:first_of_second])


def test_auto_sends_an_array_of_calls_whole_and_a_call_named_late_at_the_end() -> None:
    out = stream_calls(several("auto"), CALLS, 6)
    assert all(d == {} for d, _ in out[:-1])
    d, finish = out[-1]
    assert finish == "tool_calls" and [c["index"] for c in d["tool_calls"]] == [0, 1]
    late = '[{"name":"get_time","arguments":{"zone":"UTC"}},{"arguments":{},"name":"get_time"}]'
    deltas = [c for d, _ in stream_calls(several("required"), late, 5) if d
              for c in d["tool_calls"]]
    assert [c["id"] is not None for c in deltas if "id" in c] == [True, True]
    assert [c["index"] for c in deltas if "id" in c] == [0, 1]
    assert json.loads(deltas[-1]["function"]["arguments"]) == {}
    text = stream_calls(several("auto", parallel=False), CALLS, 6)  # one call at most: text
    assert "".join(d["content"] for d, _ in text) == CALLS and text[-1][1] == "stop"
