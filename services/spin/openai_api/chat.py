"""Chat messages into a prompt: the target tokenizer's chat template, through transformers.

The template is the tokenizer's own (``chat_template`` in its checkpoint), or a Jinja file given
with ``--chat-template`` (which wins). A tokenizer without one serves completions only: chat
requests get 400 with a message saying how to add a template. The demo models carry
``zoo.tokenizer.DEMO_CHAT_TEMPLATE`` (``role: content`` lines, then ``assistant: ``).
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from .protocol import Message, Tool

class ChatTemplate:
    """Renders messages with a tokenizer's chat template (or an override)."""

    def __init__(self, tokenizer, override: Path | str | None = None) -> None:
        """``override``: a Jinja template file used instead of the tokenizer's; OSError if it
        cannot be read."""
        self.tokenizer = tokenizer
        self.template: str | None = (Path(override).read_text() if override
                                     else getattr(tokenizer, "chat_template", None))

    @property
    def available(self) -> bool:
        return bool(self.template)

    def render(self, messages: list[Message], tools: list[Tool] | None = None) -> str:
        """The prompt text for ``messages`` (and the ``tools`` the reply may call, for a
        template that shows them), ending where the assistant's reply starts; ValueError when
        there is no template or it fails on these messages."""
        if not self.template:
            raise ValueError("the served model's tokenizer has no chat template: start the "
                             "router with --chat-template FILE (a Jinja template), or use "
                             "/v1/completions")
        plain = [{"role": m.role, "content": _text(m)}
                 | {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls),
                                      ("tool_call_id", m.tool_call_id)) if v}
                 for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                plain, chat_template=self.template, tokenize=False, add_generation_prompt=True,
                tools=[t.model_dump() for t in tools] if tools else None)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None


def _text(m: Message) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(part.text for part in m.content)
