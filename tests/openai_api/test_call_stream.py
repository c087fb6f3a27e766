"""A streamed call as OpenAI streams one (``CallStream``): with a required or named call, a
first delta with the id and name, then the arguments in fragments whose concatenation is the
arguments the whole reply gives; in ``auto`` the call held back and sent whole; text as text."""

from __future__ import annotations

import json

import pytest

from spin.openai_api import protocol as p
from spin.openai_api.structured import CallStream, tool_calls
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
