"""Vocabulary compatibility by tokens, not sizes, through ``spin serve`` with the user's own
models (``--target``, ``--drafter NAME=PATH``): a Qwen2-style target with 152064 output rows
takes a draft with 151936 rows and the same tokenizer (it drafts, and the output is the
target's); a draft whose tokenizer numbers the same words differently drafts through token
translation when the router can read its tokenizer (the output is the target's all the same),
and is refused, naming both tokenizers, when it cannot."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from real_sizes import ARCHS, bpe_tokenizer, make_pair, prompts, renumber, tokenizer
from service_helpers import collect, request
from transformers import AutoTokenizer

from spin.engine.memory import parse_size
from spin.engine.model_runner import RunnerConfig
from spin.engine.vocab import identify, incompatibility, load_identity
from spin.router.config import RouterConfig
from spin.router_main import check_drafter
from spin.serve import Embedded, ServeConfig
from spin.v1 import generation_pb2, model_info_pb2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("byo")
    target, draft = make_pair("qwen2", root)
    # byte-level BPE tokenizers (a word-level one would not load as itself: ``bpe_tokenizer``)
    bpe_tokenizer(ARCHS["qwen2"].tokens).save_pretrained(target)
    bpe_tokenizer(ARCHS["qwen2"].tokens).save_pretrained(draft)
    # the draft under a tokenizer that numbers the same tokens differently, its embedding and
    # output rows moved along: it predicts the draft's words, in other ids
    other = renumber(draft, root / "qwen2" / "draft-other-tokenizer", ARCHS["qwen2"].tokens, 1)
    return {"target": target, "draft": draft, "other": other}


def test_identity_is_the_token_map_not_the_rows(models) -> None:
    target, draft, other = (load_identity(models[k]) for k in ("target", "draft", "other"))
    assert target.fingerprint == draft.fingerprint and target.size >= ARCHS["qwen2"].tokens
    assert incompatibility(target, 152064, draft, 151936) is None
    why = incompatibility(target, 152064, other, 151936)
    assert target.name in why and other.name in why and "tokenize text differently" in why
    # without tokenizers, only equal row counts pass
    assert incompatibility(None, 152064, None, 152064) is None
    assert "152064" in incompatibility(None, 152064, None, 151936)
    assert identify(tokenizer(10)).fingerprint != identify(tokenizer(11)).fingerprint


def test_spin_serve_with_your_own_models(models, tmp_path: Path) -> None:
    cfg = ServeConfig(port=0, target=str(models["target"]),
                      drafter_models={"qwen-draft": str(models["draft"]),
                                      "other-tokenizer": str(models["other"])},
                      router=RouterConfig(policy="fixed", default_drafter="prompt-lookup"),
                      redis=False, step_times="off",  # a fixed policy needs no cost model
                      log_dir=tmp_path, runner=RunnerConfig(kv_cache_memory=parse_size("64MiB")),
                      drafter_kv_cache_memory=parse_size("32MiB"))
    ids = list(prompts(1, ARCHS["qwen2"].tokens, seed=5)[0])
    with Embedded(cfg) as emb:
        off, _, _ = collect(emb.endpoint, request(ids=ids, max_tokens=24, mode="off",
                                                  ignore_eos=True))
        on, _, last = collect(emb.endpoint, request(ids=ids, max_tokens=24, mode="drafter",
                                                    drafter="qwen-draft", k=4, ignore_eos=True))
        translated, _, last_t = collect(emb.endpoint, request(
            ids=ids, max_tokens=24, mode="drafter", drafter="other-tokenizer", k=4,
            ignore_eos=True))
        sampled = [collect(emb.endpoint, request(ids=ids, max_tokens=16, mode="drafter",
                                                 drafter="other-tokenizer", k=4, ignore_eos=True,
                                                 temperature=0.8, seed=3))[0] for _ in range(2)]
        log = (tmp_path / "router.log").read_text()
    assert on == off  # lossless through the differently padded draft
    used = {d.drafter: d for d in last.speculation.drafters}
    assert used["qwen-draft"].accepted_tokens > 0
    assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    # the other tokenizer's drafts, translated into the target's tokens: lossless, and accepted
    assert translated == off
    other = {d.drafter: d for d in last_t.speculation.drafters}["other-tokenizer"]
    assert 0 < other.accepted_tokens <= other.draft_tokens <= 4 * other.steps
    assert sampled[0] == sampled[1] and len(sampled[0]) == 16  # a seeded request reproduces
    assert any("other-tokenizer" in ln and "token translation" in ln for ln in log.splitlines())
    assert "cannot draft" not in log


class _Drafter:
    """A drafter pool that reports ``info``."""

    def __init__(self, info: model_info_pb2.ModelInfo) -> None:
        self._info = info
        self.closed = False

    async def info(self, timeout_s: float = 10.0) -> model_info_pb2.ModelInfo:
        return self._info

    async def close(self) -> None:
        self.closed = True


def _check(models, model_path: str) -> tuple[set[str], dict, dict]:
    """(rejected, drafters, translators) after the router checks the 'other-tokenizer' drafter
    reporting ``model_path``."""
    target_tok = AutoTokenizer.from_pretrained(models["target"])
    other = load_identity(models["other"])
    pool = _Drafter(model_info_pb2.ModelInfo(
        name="other-tokenizer", model_path=model_path, vocab_size=ARCHS["qwen2"].draft_vocab,
        tokenizer=other.name, tokenizer_size=other.size, tokenizer_fingerprint=other.fingerprint))
    rejected: set[str] = set()
    drafters, translators = {"other-tokenizer": pool}, {}
    target = (identify(target_tok), ARCHS["qwen2"].vocab)
    asyncio.run(check_drafter("other-tokenizer", pool, target, drafters, rejected, target_tok,
                               translators))
    return rejected, drafters, translators


def test_a_drafter_whose_tokenizer_the_router_reads_is_translated(models) -> None:
    rejected, drafters, translators = _check(models, str(models["other"]))
    assert not rejected and "other-tokenizer" in drafters and "other-tokenizer" in translators


@pytest.mark.parametrize("where", ["missing", "another"])
def test_a_drafter_whose_tokenizer_the_router_cannot_read_is_refused(
        models, tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str) -> None:
    """In a cluster the router may not see the drafter's files (or sees other ones there): the
    drafter is refused, and the log names both tokenizers and what translation needs."""
    path = str(tmp_path / "not-here") if where == "missing" else str(models["target"])
    with caplog.at_level(logging.ERROR, logger="spin.router_main"):
        rejected, drafters, translators = _check(models, path)
    assert rejected == {"other-tokenizer"} and not drafters and not translators
    line = next(r.getMessage() for r in caplog.records if "cannot draft" in r.getMessage())
    for who in ("target", "other"):  # both tokenizers named, with their fingerprints
        tok = load_identity(models[who])
        assert tok.name in line and tok.fingerprint[:12] in line
    assert "translation needs the drafter's tokenizer files on the router" in line
    assert path in line
