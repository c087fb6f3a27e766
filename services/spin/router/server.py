"""The gRPC adapter of the router: ``spin.v1.Generation`` over its ``Frontend``.

A ``GenerateRequest`` becomes a plain ``validation.ClientRequest`` here (``client_request``:
enum values outside their enum are refused first, since proto3 lets a client send any int32),
the ``Frontend`` validates and admits it (INVALID_ARGUMENT with a message for anything
malformed, and ``rpc/decode.py`` for bytes that do not even parse; RESOURCE_EXHAUSTED beyond the
bounded queue), and its stream events (``streaming.Chunk``) become ``GenerateResponse``
messages; a ``RequestFailed`` becomes the call's status. A client that cancels or runs past its
deadline frees the request's caches in every service. The process around it is built in
``router_main.py``.
"""

from __future__ import annotations

import contextlib

import grpc
from google.protobuf.message import Message

from ..engine.grammar import GrammarSpec
from ..rpc.convert import logprobs_to_proto
from ..v1 import generation_pb2, generation_pb2_grpc
from .frontend import ErrorKind, Frontend, RequestFailed
from .streaming import Chunk
from .validation import ClientRequest, SpeculationRequest

FINISH = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP}
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
"""The service this module serves."""
MODES = {generation_pb2.SPECULATION_MODE_UNSPECIFIED: "auto",
         generation_pb2.SPECULATION_MODE_AUTO: "auto",
         generation_pb2.SPECULATION_MODE_OFF: "off",
         generation_pb2.SPECULATION_MODE_DRAFTER: "drafter"}
"""``SpeculationMode`` -> ``SpeculationRequest.mode``."""


def status(kind: ErrorKind) -> grpc.StatusCode:
    """The gRPC status of a ``Frontend`` error."""
    return grpc.StatusCode[kind.name]


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """``spin.v1.Generation`` over the router's ``Frontend``: register it with ``add_servicer``
    (``rpc/decode.py``), so that a request that does not even parse is answered
    INVALID_ARGUMENT too."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        """Stream one request's tokens (module docstring)."""
        try:
            try:
                asked = client_request(request)
            except ValueError as e:
                raise Frontend.refuse(ErrorKind.INVALID_ARGUMENT, str(e)) from None
            req = self.frontend.submit(asked)
        except RequestFailed as e:
            await context.abort(status(e.kind), e.message)
        async with contextlib.aclosing(self.frontend.events(req)) as events:
            try:
                async for chunk in events:
                    yield response(chunk)
            except RequestFailed as e:
                await context.abort(status(e.kind), e.message)


def check_enums(msg: Message, prefix: str = "") -> None:
    """ValueError for the first enum field of ``msg`` (nested messages included) holding a value
    its enum does not define (proto3 enums are open: a client may send any int32)."""
    for field, value in msg.ListFields():
        name = f"{prefix}{field.name}"
        if field.enum_type is not None:
            allowed = field.enum_type.values_by_number
            for v in (value if field.is_repeated else [value]):
                if v not in allowed:
                    choices = ", ".join(f"{n} ({e.name})" for n, e in sorted(allowed.items()))
                    raise ValueError(f"{name} {v} is not a {field.enum_type.name}; allowed: "
                                     f"{choices}")
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for i, sub in enumerate(value if field.is_repeated else [value]):
                check_enums(sub, f"{name}[{i}]." if field.is_repeated else f"{name}.")


def client_request(msg: generation_pb2.GenerateRequest) -> ClientRequest:
    """What ``msg`` asks, as plain values (``validation.py`` checks them); ValueError for an enum
    value its enum does not define."""
    check_enums(msg)
    spec, s = msg.speculation, msg.sampling
    return ClientRequest(
        prompt=msg.prompt, prompt_token_ids=tuple(msg.prompt_token_ids),
        max_tokens=msg.max_tokens, temperature=s.temperature,
        top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        speculation=SpeculationRequest(mode=MODES[spec.mode], drafter=spec.drafter, k=spec.k,
                                       early_stop=spec.early_stop),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None, request_id=msg.request_id,
        prediction=msg.prediction,
        grammar=GrammarSpec(msg.grammar.kind, msg.grammar.source)  # type: ignore[arg-type]
        if msg.HasField("grammar") else None)


def response(c: Chunk) -> generation_pb2.GenerateResponse:
    """The message a client receives for a stream event."""
    st = c.step
    msg = generation_pb2.GenerateResponse(
        request_id=c.request_id, token_ids=c.token_ids, text=c.text,
        step=generation_pb2.StepInfo(
            drafter=st.drafter, k=st.k, draft_tokens=st.draft_tokens,
            accepted_tokens=st.accepted_tokens, step_seconds=st.step_seconds,
            predicted_step_seconds=st.predicted_step_seconds, batch_size=st.batch_size,
            forwards=st.forwards))
    if c.logprobs is not None:
        logprobs_to_proto(c.logprobs, msg.logprobs)
    if c.finish is not None:
        msg.finish_reason = FINISH[c.finish]
    if c.usage is not None:
        msg.usage.prompt_tokens = c.usage.prompt_tokens
        msg.usage.completion_tokens = c.usage.completion_tokens
        msg.usage.accepted_prediction_tokens = c.usage.accepted_prediction_tokens
        msg.usage.rejected_prediction_tokens = c.usage.rejected_prediction_tokens
    if c.speculation is not None:
        s, spec = msg.speculation, c.speculation
        s.steps, s.steps_without_speculation = spec.steps, spec.steps_without_speculation
        s.draft_tokens, s.accepted_tokens, s.tau = spec.draft_tokens, spec.accepted_tokens, spec.tau
        for d in spec.drafters:
            s.drafters.add(drafter=d.drafter, steps=d.steps, draft_tokens=d.draft_tokens,
                           accepted_tokens=d.accepted_tokens)
    return msg
