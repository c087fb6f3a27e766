"""Structured output and tool calls on the OpenAI API: ``response_format`` and ``tools`` /
``tool_choice`` as the router's grammar (``engine/grammar.py``), and a call's reply as OpenAI's
``tool_calls``.

- ``response_format``: ``json_object`` (any JSON object) or ``json_schema`` (its ``schema``;
  ``strict`` or not, the output follows it) constrain every generated token; speculation goes
  on as for free text (drafts are cut where the grammar rejects them, and the grammar drafts
  what it forces), and the greedy output equals constrained decoding without speculation.
- ``tools`` are rendered into the prompt by the chat template (``apply_chat_template(tools=)``,
  as the model was trained to see them). ``tool_choice`` ``required`` or a named function
  constrains the reply to one call, ``{"name": NAME, "arguments": {...}}`` with the arguments
  following the function's ``parameters`` schema, returned as ``message.tool_calls`` with
  ``finish_reason`` ``tool_calls``. ``auto`` (the default with tools) leaves the reply free and
  returns it as a call when it is one; ``none`` never calls. A call's ``arguments`` are the
  text the model wrote for them (JSON, as OpenAI's).
- Streamed, a required or named call goes out as OpenAI streams one: a first delta with the
  call's id and name once the model has written them, then the arguments in fragments as they
  are generated (``CallStream``). In ``auto`` a reply that may still become a call is held back
  and sent as one delta when complete, or streamed as text from its first character that is
  not ``{`` or space.
"""

from __future__ import annotations

import json
import re
import uuid

from ..engine.grammar import GrammarSpec
from ..router.streaming import Chunk
from . import protocol as p


class StructuredError(ValueError):
    """400: what is wrong with the request's format or tools, and the parameter."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def tool_mode(body: p.ChatCompletionRequest) -> str | None:
    """None (no call), "auto", "required" or the name of the function the reply calls."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise StructuredError(f"tool_choice names the function {choice.function.name!r}, "
                                  "which is not among tools", "tool_choice")
        return choice.function.name
    if choice != "none" and not tools:
        raise StructuredError(f"tool_choice {choice!r} needs tools", "tool_choice")
    return None if choice == "none" else choice


def call_schema(tools: list[p.Tool]) -> dict:
    """The JSON Schema of one call of one of ``tools``."""
    variants = [{"type": "object", "properties": {
        "name": {"const": t.function.name},
        "arguments": t.function.parameters or {"type": "object", "properties": {},
                                               "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def grammar_of(body: p.CompletionRequest | p.ChatCompletionRequest) -> GrammarSpec | None:
    """The request's grammar (None: free text); StructuredError for formats and tools that do
    not go together."""
    fmt = body.response_format
    mode = None
    if isinstance(body, p.ChatCompletionRequest):
        mode = tool_mode(body)
    elif any((body.model_extra or {}).get(k) is not None for k in ("tools", "tool_choice")):
        raise StructuredError("tools are served on /v1/chat/completions", "tools")
    if mode not in (None, "auto"):
        if fmt is not None and fmt.type != "text":
            raise StructuredError("a required tool call and a response_format cannot both "
                                  "shape the reply", "response_format")
        tools = [t for t in body.tools or [] if mode == "required" or t.function.name == mode]
        return GrammarSpec("json_schema", json.dumps(call_schema(tools)))
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.json_schema is None:
        raise StructuredError("response_format of type json_schema needs its json_schema",
                              "response_format")
    return GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_))


CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
"""The start of a call as the model writes it, up to the ``{`` of its arguments (group 1: the
name, JSON)."""


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object that starts at ``text[start]`` (``{``), None when it
    does not end in ``text``."""
    depth, string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if string:
            escape, string = (False, string) if escape else (ch == "\\", ch != '"')
        elif ch == '"':
            string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def tool_calls(body: p.ChatCompletionRequest, text: str) -> list[p.ToolCall] | None:
    """The reply as OpenAI's ``tool_calls`` when the request offers tools and the reply is a
    call of one of them; None otherwise. The arguments are the text the model wrote."""
    mode = tool_mode(body)
    if mode is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    names = {t.function.name for t in body.tools or []}
    if (not isinstance(value, dict) or value.keys() != {"name", "arguments"}
            or value["name"] not in names or not isinstance(value["arguments"], dict)):
        return None
    head = CALL_HEAD.match(text)
    end = _object_end(text, head.end()) if head is not None else None
    arguments = (text[head.end():end] if end is not None
                 else json.dumps(value["arguments"]))  # written arguments first
    return [p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=value["name"],
                                                                 arguments=arguments))]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """A streamed chat reply that may be a call (module doc): a required or named call streamed
    as its arguments come; in ``auto`` text held back while it may still become a call, then
    streamed as content or sent as one ``tool_calls`` delta at the end."""

    def __init__(self, body: p.ChatCompletionRequest) -> None:
        self.body = body
        self.mode = tool_mode(body)
        self._held: dict[int, str] = {}
        """Choice index -> the reply so far, while it is held back or streamed as a call."""
        self._free: set[int] = set()
        """Choices whose reply is text (streamed as it comes)."""
        self._sent: dict[int, int] = {}
        """Choices streaming a call -> the end of the arguments text sent so far."""

    def delta(self, index: int, chunk: Chunk) -> tuple[dict, str | None]:
        """The delta to send for ``chunk`` of choice ``index`` and its finish reason."""
        if self.mode is None or index in self._free:
            return {"content": chunk.text}, chunk.finish
        held = self._held.get(index, "") + chunk.text
        self._held[index] = held
        if self.mode != "auto":  # the grammar makes the reply a call: stream it
            return self._call_delta(index, held, chunk.finish)
        if held.strip() and not held.lstrip().startswith("{"):
            self._free.add(index)
            self._held.pop(index, None)
            return {"content": held}, chunk.finish
        return self._whole(index, held, chunk.finish)

    def _whole(self, index: int, held: str, finish: str | None) -> tuple[dict, str | None]:
        """The reply held back, once complete: one call, or text."""
        if finish is None:
            return {}, None
        calls = tool_calls(self.body, held)
        self._held.pop(index, None)
        if calls is None:
            return {"content": held}, finish
        return {"content": None, "tool_calls": [{"index": 0, **calls[0].model_dump()}]}, \
            "tool_calls"

    def _call_delta(self, index: int, held: str, finish: str | None) -> tuple[dict, str | None]:
        """A required or named call's next delta: its id and name once written, then each
        fragment of its arguments (never the closing brace of the call around them)."""
        head = CALL_HEAD.match(held)
        if head is None:  # the name not written yet (or written after the arguments)
            return self._whole(index, held, finish)
        call: dict = {"index": 0}
        if index not in self._sent:
            self._sent[index] = head.end()
            call |= {"id": new_call_id(), "type": "function",
                     "function": {"name": json.loads(f'"{head.group(1)}"'), "arguments": ""}}
        end = _object_end(held, head.end()) or len(held)
        fragment, self._sent[index] = held[self._sent[index]:end], max(self._sent[index], end)
        if fragment:
            call.setdefault("function", {})["arguments"] = fragment
        if finish is not None:
            self._held.pop(index, None)
            self._sent.pop(index, None)
            finish = "tool_calls" if finish == "stop" else finish
        if len(call) == 1 and finish is None:
            return {}, None
        return {"content": None, "tool_calls": [call]} if len(call) > 1 else {}, finish
