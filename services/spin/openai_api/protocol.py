"""The OpenAI API's request and response bodies, as the router serves them (pydantic models).

They are the schema ``/openapi.json`` publishes. Fields follow OpenAI's API reference; the ones
it has and we do not serve (``echo``, ``best_of``, ``suffix``, ``logit_bias``, non-zero
penalties, audio) are refused with 400 rather than ignored. Our extension: ``speculation`` on a
request (per-request control of the drafter and k, which no other server offers) and
``usage.speculation`` on a response (what speculation did for that request).

Predicted Outputs (OpenAI's ``prediction: {"type": "content", "content": TEXT}``, the content a
string or a list of text parts; on chat and completions alike) are speculation with the client's
draft: the ``prediction`` drafter drafts the prediction's next tokens where the output stands in
it (``engine/prediction.py``), and the target verifies them as any drafter's, so a prediction
never changes the output. The policy picks it per step like any drafter (or a request names it:
``speculation.drafter: "prediction"``). ``usage.completion_tokens_details`` reports its
``accepted_prediction_tokens`` and ``rejected_prediction_tokens`` (0 without a prediction).

Structured output (``response_format``) and tool calls (``tools``, ``tool_choice``) constrain
the output with a grammar under speculation: ``openai_api/structured.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
"""Choices per prompt at most (``n``)."""
MAX_TOP_LOGPROBS = 20
"""Alternatives per token at most (chat's ``top_logprobs``; completions' ``logprobs`` up to 5)."""


class _Request(BaseModel):
    # unknown fields pass, as OpenAI's own server lets new client fields through
    model_config = ConfigDict(extra="allow")


class SpeculationOptions(BaseModel):
    """Per-request speculation (an extension: the official clients send it as ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "off", "drafter"] = "auto"
    """auto: the router's policy chooses the drafter and k every step; off: the target alone;
    drafter: always ``drafter``, with ``k`` (or the policy's k)."""
    drafter: str = Field("", max_length=128)
    """The drafter of mode drafter (``GET /v1/models`` lists them under ``spin.drafters``)."""
    k: int = Field(0, ge=0, le=16)
    """Draft tokens per step in mode drafter (0: the policy's choice)."""
    early_stop: bool = False
    """With ``k``: a model drafter's chain stops early where the policy's do, so ``k`` is the
    longest chain (as with the policy's k)."""


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """Predicted Outputs (module docstring): text the output is expected to repeat in large part
    (a file rewritten with a change)."""

    type: str = "content"
    """Only "content" is served (anything else: 400)."""
    content: str | list[ContentPart]
    """The predicted text, or its text parts (joined)."""


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(True, alias="schema")
    """The JSON Schema the output follows (omitted: any JSON value)."""
    strict: bool | None = None
    """Accepted for compatibility: the output always follows the schema."""


class ResponseFormat(BaseModel):
    """Structured output (``openai_api/structured.py``): ``text`` (free), ``json_object`` (any
    JSON object) or ``json_schema`` (``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    """The arguments' JSON Schema (omitted: no arguments, ``{}``)."""
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send one more chunk before ``[DONE]``, with no choices and the request's usage."""


Stop = str | Annotated[list[str], Field(max_length=16)] | None


class _Sampling(_Request):
    model: str
    """The served model (``GET /v1/models``)."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """0: greedy (the target's output token for token); default 1."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    """Choices per prompt (each sampled on its own; with a seed, choice i uses seed + i)."""
    stream: bool = False
    """Stream server-sent events, one per verification step of each choice."""
    stream_options: StreamOptions | None = None
    stop: Stop = None
    """Up to 16 strings; the text stops before the first that appears (it is not returned)."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Sampling seed: without speculation the same seed and request give the same output;
    with it, the same distribution (the tokens depend on the drafts too)."""
    user: str | None = None
    """The end user's id (logged with the request)."""
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    speculation: SpeculationOptions | None = None
    """How this request speculates (default: the router's policy)."""
    ignore_eos: bool = False
    """Do not stop at the end-of-sequence token (an extension, as vLLM's: benchmarks)."""
    return_token_ids: bool = False
    """Also return each choice's token ids (``token_ids``; an extension, as vLLM's)."""
    response_format: ResponseFormat | None = None
    """Structured output: the output follows the format (``openai_api/structured.py``; on
    completions an extension, as vLLM's)."""
    prediction: Prediction | None = None
    """Predicted Outputs: drafted from, never changing the output (module docstring); at most
    262144 characters."""


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, several texts (one completion each), token ids, or several lists of token ids."""
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    """Return the log-probabilities of each emitted token and its ``logprobs`` most likely
    alternatives (the target's distribution before temperature and top-p)."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    """An assistant message's calls (passed to the chat template as they are)."""
    tool_call_id: str | None = None
    """A tool message's call."""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI for ``max_completion_tokens``; either works."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    """Functions the reply may call (rendered into the prompt by the chat template)."""
    tool_choice: ToolChoice | None = None
    """none, auto (default with tools: text, or calls when the reply is calls), required (calls,
    their arguments following the functions' schemas) or a named function (one call of it)."""
    parallel_tool_calls: bool | None = None
    """With ``auto`` or ``required``, the reply may call several functions (a JSON array of
    calls); false: one call at most. None: true, as OpenAI's default."""


# ---- responses ------------------------------------------------------------------------------------
class DrafterUsage(BaseModel):
    drafter: str
    steps: int
    draft_tokens: int
    accepted_tokens: int


class SpeculationUsage(BaseModel):
    """What speculation did for the request (summed over its choices)."""

    steps: int
    """Verification steps."""
    steps_without_speculation: int
    draft_tokens: int
    accepted_tokens: int
    tau: float
    """Tokens per verification step."""
    drafters: list[DrafterUsage]


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    """Tokens drafted from the prediction that the target accepted."""
    rejected_prediction_tokens: int = 0
    """Tokens drafted from the prediction that the target rejected."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None
    speculation: SpeculationUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int] | None = None
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    token_ids: list[int] | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spin"
    max_model_len: int | None = None
    drafters: list[str] | None = None
    """The drafters a request may name in ``speculation.drafter`` (an extension)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, as OpenAI sends them."""

    error: ErrorBody


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
