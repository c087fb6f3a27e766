"""Chat templates: the tokenizer's own, an override file, and a clear error without one."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from spin.openai_api.chat import ChatTemplate
from spin.openai_api.protocol import ContentPart, Message
from spin.zoo.tokenizer import DEMO_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok(family_dir: Path):
    return AutoTokenizer.from_pretrained(family_dir / "target")


def test_the_demo_tokenizer_carries_the_demo_template(tok) -> None:
    assert tok.chat_template == DEMO_CHAT_TEMPLATE
    text = ChatTemplate(tok).render([Message(role="system", content="Be brief."),
                                     Message(role="user", content=[
                                         ContentPart(type="text", text="def "),
                                         ContentPart(type="text", text="f():")])])
    assert text == "system: Be brief.\nuser: def f():\nassistant: "


def test_an_override_file_wins(tok, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>>")
    assert ChatTemplate(tok, path).render([Message(role="user", content="hi")]) == "<user>hi>>"


def test_without_a_template_chat_is_refused_with_the_fix(tok) -> None:
    bare = ChatTemplate(tok)
    bare.template = None
    with pytest.raises(ValueError, match="--chat-template FILE"):
        bare.render([Message(role="user", content="hi")])


def test_a_broken_template_is_a_value_error(tok, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ raise_exception('no system messages') }}")
    with pytest.raises(ValueError, match="no system messages"):
        ChatTemplate(tok, path).render([Message(role="system", content="x")])
