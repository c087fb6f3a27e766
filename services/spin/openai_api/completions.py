"""An OpenAI completion or chat request as the router's requests, and their events as OpenAI's
bodies and server-sent events.

Each (prompt, choice) pair is one plain ``ClientRequest`` through the router's ``Frontend`` (the
path the gRPC API's requests take too, so a greedy output is the same token for token; no
protobuf on the way); choice ``i`` of a
seeded request uses ``seed + i``. All of a request's choices are admitted before anything is
sent, so a full queue answers 429 and nothing half-runs; a choice that fails later ends the
response (an ``error`` event when streaming). Leaving early (the client went away) cancels every
choice and frees their caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.grammar import GrammarSpec
from ..engine.prediction import PREDICTION
from ..router.frontend import Frontend, RequestFailed
from ..router.requests import RouterRequest
from ..router.streaming import Chunk, SpeculationStats
from ..router.validation import ClientRequest, SpeculationRequest
from . import protocol as p

UNSUPPORTED = ("logit_bias", "functions", "function_call", "audio", "modalities")
"""Request fields OpenAI has that we refuse (400) rather than silently ignore."""


class BadRequest(ValueError):
    """400: what is wrong, and the parameter (``param`` of the error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Choice:
    """One choice's state while it runs."""

    index: int
    prompt: int
    """Which prompt it completes (usage counts each prompt once)."""
    req: RouterRequest
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    speculation: SpeculationStats | None = None


def check_common(body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
    """400 for what we do not serve (module docstring of ``protocol.py``), and for text that is
    no Unicode (JSON's escapes can carry lone surrogates, which no tokenizer or protobuf
    string takes)."""
    try:
        json.dumps(body.model_dump(), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the request's text has a lone surrogate (\\ud800-\\udfff): not "
                         "valid Unicode") from None
    extra = set(body.model_extra or {})
    for name in UNSUPPORTED:
        if name in extra and body.model_extra[name] is not None:
            raise BadRequest(f"{name} is not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported by this server (only 0)", name)
    if body.prediction is not None and body.prediction.type != "content":
        raise BadRequest(f"prediction.type {body.prediction.type!r} is not supported: only "
                         "'content'", "prediction")


def prediction_text(body: p.CompletionRequest | p.ChatCompletionRequest) -> str:
    """The request's predicted output as one text ('' without one)."""
    pred = body.prediction
    if pred is None:
        return ""
    if isinstance(pred.content, str):
        return pred.content
    return "".join(part.text for part in pred.content)


def prompts_of(body: p.CompletionRequest) -> list[str | list[int]]:
    """The completion request's prompts: texts or lists of token ids."""
    if body.echo:
        raise BadRequest("echo is not supported by this server", "echo")
    if body.best_of not in (None, 1):
        raise BadRequest("best_of is not supported by this server (only 1)", "best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported by this server", "suffix")
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    if any(isinstance(x, list) and not x for x in prompt):
        raise BadRequest("a prompt's token list is empty", "prompt")
    return list(prompt)


def client_request(request_id: str, prompt: str | list[int], max_tokens: int,
                   body: p.CompletionRequest | p.ChatCompletionRequest, choice: int,
                   logprobs: int | None, trace: tuple[str, str] = ("", ""),
                   grammar: GrammarSpec | None = None) -> ClientRequest:
    """One choice as the router's plain request (the router's validation, ``Frontend.submit``,
    checks it); ``trace``: the call's ``traceparent`` and ``tracestate`` headers; ``grammar``:
    the output's (``structured.grammar_of``)."""
    spec = body.speculation or p.SpeculationOptions()
    return ClientRequest(
        prompt=prompt if isinstance(prompt, str) else "",
        prompt_token_ids=() if isinstance(prompt, str) else tuple(prompt),
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else (body.seed + choice) % 2**63,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        ignore_eos=body.ignore_eos, logprobs=logprobs, request_id=request_id,
        prediction=prediction_text(body), grammar=grammar,
        speculation=SpeculationRequest(mode=spec.mode, drafter=spec.drafter, k=spec.k,
                                       early_stop=spec.early_stop),
        traceparent=trace[0], tracestate=trace[1])


def submit_all(frontend: Frontend, reqs: list[tuple[int, ClientRequest]]) -> list[Choice]:
    """Admit every choice, or none: RequestFailed after cancelling those already admitted."""
    choices: list[Choice] = []
    try:
        for prompt, req in reqs:
            choices.append(Choice(len(choices), prompt, frontend.submit(req)))
    except RequestFailed:
        for c in choices:
            frontend.cancel(c.req)
        raise
    return choices


async def merged(frontend: Frontend, choices: list[Choice]) -> AsyncIterator[tuple[Choice, Chunk]]:
    """Every choice's chunks as they come; RequestFailed when one fails. Leaving early cancels
    every choice."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(c: Choice) -> None:
        try:
            async with contextlib.aclosing(frontend.events(c.req)) as events:
                async for chunk in events:
                    await queue.put((c, chunk))
        except RequestFailed as e:
            await queue.put(e)
        finally:
            await queue.put(done)

    async with contextlib.AsyncExitStack() as stack:
        tasks = [asyncio.create_task(pump(c)) for c in choices]
        stack.callback(lambda: [t.cancel() for t in tasks])
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                yield item


def usage(choices: list[Choice]) -> p.Usage:
    """Token counts (each prompt once) and the speculation of all choices together."""
    prompts = {c.prompt: len(c.req.prompt) for c in choices}
    completion = sum(len(c.token_ids) for c in choices)
    stats = [c.speculation for c in choices if c.speculation is not None]
    spec = None
    if stats:
        drafters: dict[str, list[int]] = {}
        for s in stats:
            for d in s.drafters:
                row = drafters.setdefault(d.drafter, [0, 0, 0])
                row[0] += d.steps
                row[1] += d.draft_tokens
                row[2] += d.accepted_tokens
        steps = sum(s.steps for s in stats)
        spec = p.SpeculationUsage(
            steps=steps, steps_without_speculation=sum(s.steps_without_speculation for s in stats),
            draft_tokens=sum(s.draft_tokens for s in stats),
            accepted_tokens=sum(s.accepted_tokens for s in stats),
            tau=completion / steps if steps else 0.0,
            drafters=[p.DrafterUsage(drafter=n, steps=a, draft_tokens=b, accepted_tokens=c)
                      for n, (a, b, c) in sorted(drafters.items())])
    total_prompt = sum(prompts.values())
    return p.Usage(prompt_tokens=total_prompt, completion_tokens=completion,
                   total_tokens=total_prompt + completion,
                   completion_tokens_details=_prediction_details(stats), speculation=spec)


def _prediction_details(stats: list[SpeculationStats]) -> p.CompletionTokensDetails:
    """The ``prediction`` drafter's tokens the target accepted and rejected, over ``stats``."""
    mine = [d for s in stats for d in s.drafters if d.drafter == PREDICTION]
    accepted = sum(d.accepted_tokens for d in mine)
    return p.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                     rejected_prediction_tokens=sum(d.draft_tokens for d in mine)
                                     - accepted)


def record(c: Choice, chunk: Chunk) -> None:
    """Add a chunk to its choice."""
    c.text.append(chunk.text)
    c.token_ids += chunk.token_ids
    if chunk.logprobs is not None:
        c.logprobs += chunk.logprobs
    if chunk.finish is not None:
        c.finish, c.speculation = chunk.finish, chunk.speculation


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
