"""Per-request contexts kept by a drafter or verifier between batches.

The router sends each service only what changed: ``keep`` tokens of what it sent before still hold,
``delta`` follows them. A service that does not hold ``keep`` tokens for the request (it restarted,
or never saw it) answers *resync* and the router sends the whole context next time.
"""

from __future__ import annotations


class ContextBook:
    """request id -> the request's whole context as this service knows it."""

    def __init__(self) -> None:
        self._ctx: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._ctx)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ctx

    def apply(self, request_id: str, keep: int, delta: list[int] | tuple[int, ...]) -> tuple[int, ...] | None:
        """The context after the update, or None (resync) when ``keep`` tokens are not held."""
        held = self._ctx.get(request_id)
        if keep < 0 or (keep > 0 and (held is None or len(held) < keep)):
            return None
        if held is None:
            held = self._ctx[request_id] = []
        del held[keep:]
        held.extend(delta)
        return tuple(held)

    def extend(self, request_id: str, tokens: list[int] | tuple[int, ...]) -> None:
        """Append tokens the service decided itself (the verifier's emitted tokens)."""
        self._ctx[request_id].extend(tokens)

    def release(self, request_id: str) -> bool:
        """Forget a request; False when it was unknown."""
        return self._ctx.pop(request_id, None) is not None
