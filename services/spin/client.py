"""``spin generate``: stream one completion from a running router, then its speed and speculation."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

import grpc

from .rpc import credentials
from .v1 import generation_pb2, generation_pb2_grpc, sampling_pb2


@dataclass
class GenerateArgs:
    """One generation request from the command line."""

    prompt: str
    endpoint: str = "127.0.0.1:50051"
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    speculation: str = "auto"
    """auto, off, or a drafter name."""
    k: int = 0
    """k for a named drafter (0 = the router's)."""
    stop: tuple[str, ...] = ()
    steps: bool = False
    """After the summary, print every verification step: drafter, k, accepted, time."""
    api_key: str | None = None
    """The router's API key (None: none)."""
    tls_ca: str | None = None
    """Connect over TLS, trusting this CA file ('' = the system's roots); None: plaintext."""
    timeout_s: float = 300.0
    prediction: str = ""
    """Predicted Outputs: text the output is expected to repeat ('' = none)."""


def build_request(a: GenerateArgs) -> generation_pb2.GenerateRequest:
    sampling = sampling_pb2.SamplingParams(temperature=a.temperature, top_k=a.top_k)
    if a.top_p is not None:
        sampling.top_p = a.top_p
    if a.seed is not None:
        sampling.seed = a.seed
    if a.speculation == "auto":
        spec = generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_AUTO)
    elif a.speculation == "off":
        spec = generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_OFF)
    else:
        spec = generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_DRAFTER,
                                          drafter=a.speculation, k=a.k)
    return generation_pb2.GenerateRequest(prompt=a.prompt, max_tokens=a.max_tokens,
                                          sampling=sampling, stop=a.stop, speculation=spec,
                                          prediction=a.prediction)


def generate(a: GenerateArgs, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Stream to ``out``; summary to ``err``. Exit code: 0, 2 bad request, 1 other errors."""
    with credentials.channel(a.endpoint, a.tls_ca) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            print(f"spin generate: cannot reach the router at {a.endpoint}; start it with "
                  "`spin serve`", file=err)
            return 2
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        first = None
        last = None
        steps: list[tuple[generation_pb2.StepInfo, int]] = []  # (step, tokens it emitted)
        try:
            for msg in stub.Generate(build_request(a), timeout=a.timeout_s,
                                     metadata=credentials.metadata(a.api_key)):
                if msg.token_ids and first is None:
                    first = time.perf_counter()
                out.write(msg.text)
                out.flush()
                if msg.HasField("step"):
                    steps.append((msg.step, len(msg.token_ids)))
                last = msg
        except grpc.RpcError as e:
            print(f"\nspin generate: {e.code().name}: {e.details()}", file=err)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    elapsed = time.perf_counter() - start
    s, u = last.speculation, last.usage
    drafters = ", ".join(f"{d.drafter} ({d.steps} steps, {d.accepted_tokens}/{d.draft_tokens} "
                         f"accepted)" for d in s.drafters) or "none"
    reason = generation_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    print(f"\n\n{u.completion_tokens} tokens in {elapsed:.2f} s = "
          f"{u.completion_tokens / elapsed:.1f} tokens/s (first token after "
          f"{((first or start) - start) * 1000:.0f} ms); tau {s.tau:.2f} tokens/step over "
          f"{s.steps} steps ({s.steps_without_speculation} without speculation); drafters: "
          f"{drafters}; finished: {reason.lower()}", file=err)
    if a.steps:
        print(step_table(steps), file=err)
    return 0


def step_table(steps: list[tuple[generation_pb2.StepInfo, int]]) -> str:
    """One line per verifier call (what the policy chose and how it went; ``fwd``: the target
    forwards it ran, several for plain steps held in one call, which the summary's steps count
    one by one), then the mean error of the policy's step-time predictions over the calls that
    had one."""
    lines = [f"{'call':>4}  {'drafter':<18} {'k':>2} {'drafted':>7} {'accepted':>8} "
             f"{'tokens':>6} {'fwd':>3} {'batch':>5} {'ms':>7} {'predicted':>9}"]
    errors = []
    for i, (s, tokens) in enumerate(steps, 1):
        predicted = f"{s.predicted_step_seconds * 1e3:9.1f}" if s.predicted_step_seconds else \
            f"{'-':>9}"
        lines.append(f"{i:>4}  {s.drafter or '(none)':<18} {s.k:>2} {s.draft_tokens:>7} "
                     f"{s.accepted_tokens:>8} {tokens:>6} {max(s.forwards, 1):>3} "
                     f"{s.batch_size:>5} {s.step_seconds * 1e3:7.1f} {predicted}")
        if s.predicted_step_seconds and s.step_seconds > 0:
            errors.append(abs(s.predicted_step_seconds - s.step_seconds) / s.step_seconds)
    if errors:
        lines.append(f"predicted vs measured step time: mean absolute error "
                     f"{100 * sum(errors) / len(errors):.1f}% over {len(errors)} steps")
    return "\n".join(lines)
