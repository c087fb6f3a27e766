"""Prompts from a file of your own (``--dataset PATH``), in the formats load generators read.

- JSON Lines (``.jsonl``): one object a line with ``prompt`` (a string) or ``messages`` (a chat,
  OpenAI's shape); an optional ``domain`` labels the request in the report, an optional ``split``
  (``tuning`` or ``evaluation``) puts it in one half (loadgen's ``--split``);
- ShareGPT (``.json``): a list of ``{"conversations": [{"from": "human", "value": ...}, ...]}``;
  each conversation's first human turn is a prompt;
- anything else: plain text, one prompt a line (blank lines skipped).

Chats become prompt text through ``render`` (the target tokenizer's chat template: the gRPC API
takes text). A line that is none of these is an error naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Render = Callable[[list[dict]], str]
"""Chat messages -> prompt text."""
DEFAULT_SOURCE = (Path(__file__).resolve().parents[1] / "benchmarks" / "datasets"
                  / "unseen-long.jsonl")
"""Text from outside the demo corpus, split into tuning and evaluation halves (``spin bench
dataset``): what the chat, edit and schema workloads are built from."""


def read_jsonl(path: Path) -> list:
    """Every object of a JSON Lines file, in file order (blank lines skipped); no checks (a
    workload's own rows: ``read_prompts`` reads a user's ``--dataset``)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON Lines at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def read_prompts(path: Path, render: Render | None = None) -> list[dict[str, str]]:
    """``path``'s prompts as rows ``{"domain", "prompt"}``; ValueError for what cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if path.suffix == ".jsonl":
        rows = [_jsonl_row(line, path, i, render) for i, line in enumerate(text.splitlines(), 1)
                if line.strip()]
    elif path.suffix == ".json":
        rows = _sharegpt(text, path)
    else:
        rows = [{"domain": "dataset", "prompt": line} for line in text.splitlines()
                if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no prompts")
    return rows


def _jsonl_row(line: str, path: Path, n: int, render: Render | None) -> dict[str, str]:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    domain = str(obj.get("domain", "dataset")) if isinstance(obj, dict) else "dataset"
    extra = ({"split": obj["split"]} if isinstance(obj, dict) and obj.get("split") in
             ("tuning", "evaluation") else {})
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return {"domain": domain, "prompt": obj["prompt"], **extra}
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
        if render is None:
            raise ValueError(f"{path}:{n}: a chat needs a tokenizer with a chat template "
                             f"(--tokenizer)")
        return {"domain": domain, "prompt": render(obj["messages"]), **extra}
    raise ValueError(f"{path}:{n}: wants an object with a non-empty 'prompt' or 'messages'")


def _sharegpt(text: str, path: Path) -> list[dict[str, str]]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT wants a list of conversations")
    rows = []
    for conv in data:
        turns = conv.get("conversations", []) if isinstance(conv, dict) else []
        first = next((t.get("value") for t in turns if isinstance(t, dict)
                      and t.get("from") in ("human", "user") and t.get("value")), None)
        if first:
            rows.append({"domain": "sharegpt", "prompt": first})
    return rows


def chat_renderer(tokenizer_dir: str | Path) -> Render:
    """Messages -> text with the tokenizer's chat template (as the router's HTTP API renders)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer at {tokenizer_dir} has no chat template")
    return lambda messages: tok.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
