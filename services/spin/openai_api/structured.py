"""Structured output and tool calls on the OpenAI API: ``response_format`` and ``tools`` /
``tool_choice`` as the router's grammar (``engine/grammar.py``), and a call's reply as OpenAI's
``tool_calls``.

- ``response_format``: ``json_object`` (any JSON object) or ``json_schema`` (its ``schema``;
  ``strict`` or not, the output follows it) constrain every generated token; speculation goes
  on as for free text (drafts are cut where the grammar rejects them, and the grammar drafts
  what it forces), and the greedy output equals constrained decoding without speculation.
- ``tools`` are rendered into the prompt by the chat template (``apply_chat_template(tools=)``,
  as the model was trained to see them). ``tool_choice`` ``required`` constrains the reply to a
  call, ``{"name": NAME, "arguments": {...}}`` with the arguments following the function's
  ``parameters`` schema, or, unless ``parallel_tool_calls`` is false, to a JSON array of one or
  more calls (vLLM's required calls are such an array); a named function, to one call of it.
  The calls come back as ``message.tool_calls`` with ``finish_reason`` ``tool_calls``. ``auto``
  (the default with tools) leaves the reply free and returns it as calls when it is a call (or,
  with parallel calls, an array of calls); ``none`` never calls. A call's ``arguments`` are the
  text the model wrote for them (JSON, as OpenAI's).
- Streamed, required or named calls go out as OpenAI streams them: for each call (``index`` 0,
  1, ...) a first delta with its id and name once the model has written them, then its
  arguments in fragments as they are generated (``CallStream``). In ``auto`` a reply that may
  still become a call is held back and sent as one delta when complete, or streamed as text
  from its first character that is not ``{`` (or ``[``, with parallel calls) or space.
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


def parallel(body: p.ChatCompletionRequest, mode: str | None) -> bool:
    """The reply may be several calls: ``parallel_tool_calls`` (OpenAI's default: true) with
    ``auto`` or ``required`` (a named function is called once)."""
    return body.parallel_tool_calls is not False and mode in ("auto", "required")


def call_schema(tools: list[p.Tool], several: bool = False) -> dict:
    """The JSON Schema of one call of one of ``tools`` (``several``: or of an array of one or
    more such calls)."""
    one = _one_call_schema(tools)
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if several else one


def _one_call_schema(tools: list[p.Tool]) -> dict:
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
        return GrammarSpec("json_schema", json.dumps(call_schema(tools, parallel(body, mode))))
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


ARRAY_START = re.compile(r"\s*\[")
NEXT_CALL = re.compile(r"\s*\}\s*,")
"""A call's closing brace after its arguments, and the comma before the next call."""


def scan_calls(text: str) -> list[tuple[str, int, int | None]]:
    """The calls written so far in ``text`` (one call, or an array of them), in order: (name,
    where its arguments start, where they end or None while they go on). A call whose name
    follows its arguments ends the scan."""
    array = ARRAY_START.match(text)
    pos, out = (array.end() if array else 0), []
    while (head := CALL_HEAD.match(text, pos)) is not None:
        end = _object_end(text, head.end())
        out.append((json.loads(f'"{head.group(1)}"'), head.end(), end))
        if not array or end is None or (sep := NEXT_CALL.match(text, end)) is None:
            break
        pos = sep.end()
    return out


def tool_calls(body: p.ChatCompletionRequest, text: str) -> list[p.ToolCall] | None:
    """The reply as OpenAI's ``tool_calls`` when the request offers tools and the reply is a
    call of one of them (or, with parallel calls, an array of such calls); None otherwise. The
    arguments are the text the model wrote."""
    mode = tool_mode(body)
    if mode is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) and parallel(body, mode) else [value]
    names = {t.function.name for t in body.tools or []}
    if not items or not all(
            isinstance(v, dict) and v.keys() == {"name", "arguments"} and v["name"] in names
            and isinstance(v["arguments"], dict) for v in items):
        return None
    written = scan_calls(text)
    if len(written) != len(items) or any(end is None for _, _, end in written):
        written = []  # a name after its arguments: the arguments as parsed
    arguments = [text[start:end] for _, start, end in written] or [
        json.dumps(v["arguments"]) for v in items]
    return [p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=v["name"], arguments=a))
            for v, a in zip(items, arguments)]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """A streamed chat reply that may be calls (module doc): required or named calls streamed
    as their arguments come; in ``auto`` text held back while it may still become calls, then
    streamed as content or sent as one ``tool_calls`` delta at the end."""

    def __init__(self, body: p.ChatCompletionRequest) -> None:
        self.body = body
        self.mode = tool_mode(body)
        self._starts = ("{", "[") if parallel(body, self.mode) else ("{",)
        """How a reply that is calls begins."""
        self._held: dict[int, str] = {}
        """Choice index -> the reply so far, while it is held back or streamed as calls."""
        self._free: set[int] = set()
        """Choices whose reply is text (streamed as it comes)."""
        self._sent: dict[int, list[int]] = {}
        """Choices streaming calls -> per call announced, the end of its arguments sent."""

    def delta(self, index: int, chunk: Chunk) -> tuple[dict, str | None]:
        """The delta to send for ``chunk`` of choice ``index`` and its finish reason."""
        if self.mode is None or index in self._free:
            return {"content": chunk.text}, chunk.finish
        held = self._held.get(index, "") + chunk.text
        self._held[index] = held
        if self.mode != "auto":  # the grammar makes the reply calls: stream them
            return self._call_delta(index, held, chunk.finish)
        if held.strip() and not held.lstrip().startswith(self._starts):
            self._free.add(index)
            self._held.pop(index, None)
            return {"content": held}, chunk.finish
        return self._whole(index, held, chunk.finish)

    def _whole(self, index: int, held: str, finish: str | None) -> tuple[dict, str | None]:
        """The reply held back, once complete: calls, or text."""
        if finish is None:
            return {}, None
        calls = tool_calls(self.body, held)
        self._held.pop(index, None)
        if calls is None:
            return {"content": held}, finish
        return {"content": None, "tool_calls": [{"index": i, **c.model_dump()}
                                                for i, c in enumerate(calls)]}, "tool_calls"

    def _call_delta(self, index: int, held: str, finish: str | None) -> tuple[dict, str | None]:
        """Required or named calls' next delta: each call's id and name once written, then
        each fragment of its arguments (never the closing brace of the call around them)."""
        written = scan_calls(held)
        if not written and index not in self._sent:  # no name written yet (or after arguments)
            return self._whole(index, held, finish)
        sent = self._sent.setdefault(index, [])
        calls = []
        for i, (name, start, end) in enumerate(written):
            call: dict = {"index": i}
            if i == len(sent):
                sent.append(start)
                call |= {"id": new_call_id(), "type": "function",
                         "function": {"name": name, "arguments": ""}}
            stop = end if end is not None else len(held)
            if stop > sent[i]:
                call.setdefault("function", {})["arguments"] = held[sent[i]:stop]
                sent[i] = stop
            if len(call) > 1:
                calls.append(call)
        if finish is not None:
            whole = tool_calls(self.body, held) or []
            calls += [{"index": i, **c.model_dump()} for i, c in enumerate(whole)
                      if i >= len(sent)]  # calls whose names followed their arguments
            self._held.pop(index, None)
            self._sent.pop(index, None)
            finish = "tool_calls" if finish == "stop" else finish
        return ({"content": None, "tool_calls": calls} if calls else {}), finish
