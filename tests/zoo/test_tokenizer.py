import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from spin.zoo.specs import DEMO_FAMILY, FamilySpec
from spin.zoo.tokenizer import EOS, encode_corpus, train_tokenizer

SAMPLES = [
    "def f(x):\n    return {'a': [x, 2]}  # comment\n\ttabbed\n",
    "grep searches for PATTERNS in each FILE.  Two  spaces, trailing space ",
    '{"id": 1001, "name": "ada.lovelace", "price": 12.50}\n2024-01-02T03:04:05Z INFO ok',
    "Unicode: naïve café — 日本語 🙂 and bytes \x00\x7f",
    "",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_committed_tokenizer_round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_committed_tokenizer_shape(tokenizer: PreTrainedTokenizerBase) -> None:
    assert 4000 <= len(tokenizer) <= 8192
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOS
    # Byte-level BPE compresses code: fewer tokens than bytes by a wide margin.
    code = Path(__file__).read_text()
    assert len(tokenizer(code)["input_ids"]) < len(code.encode()) / 2.2


def test_every_model_shares_the_tokenizer(family_dir: Path) -> None:
    ref = json.loads((family_dir / "target" / "tokenizer.json").read_text())["model"]["vocab"]
    for model_dir in family_dir.glob("draft-*"):
        assert json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"] == ref


def test_train_and_encode_small_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = {"code": "def add(a, b):\n    return a + b\n", "prose": "The quick brown fox jumps. ",
            "structured": '{"k": 1, "v": "x"}\n'}
    for domain, text in rows.items():
        for split in ("train", "heldout"):
            with open(corpus / f"{domain}.{split}.jsonl", "w") as f:
                for i in range(20):
                    f.write(json.dumps({"id": f"{domain}{i}", "text": text * (i + 1)}) + "\n")
    family = FamilySpec(models=DEMO_FAMILY.models, vocab_size=300)
    tok = train_tokenizer(family, corpus, tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(reloaded) == len(tok) <= 300
    stats = encode_corpus(reloaded, corpus, tmp_path / "tokens")
    arr = np.load(tmp_path / "tokens" / "code.train.npy")
    assert arr.dtype == np.uint16 and stats["code.train"]["tokens"] == arr.size
    assert int((arr == reloaded.eos_token_id).sum()) == 20  # one EOS after each document
    first = arr[: int(np.argmax(arr == reloaded.eos_token_id))]
    assert reloaded.decode(first.tolist()) == rows["code"]
