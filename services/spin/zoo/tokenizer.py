"""The shared byte-level BPE tokenizer and the corpus token arrays.

Byte-level BPE round-trips any UTF-8 text exactly (``decode(encode(s)) == s``), so code indentation
and log formats survive. One special token, ``<|endoftext|>``, is BOS, EOS and padding alike.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from .corpus import read_documents
from .specs import DOMAINS, FamilySpec

EOS = "<|endoftext|>"
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}\n"
)
"""The demo tokenizer's chat template (the router's OpenAI API renders chat requests with it):
one ``role: content`` line per message, then ``assistant: ``."""
_SAMPLE_CHARS_PER_DOMAIN = 3_000_000


def train_tokenizer(family: FamilySpec, corpus_dir: Path, out_dir: Path) -> PreTrainedTokenizerFast:
    """Train BPE on an equal-size sample of each domain's training split; save it to ``out_dir``."""
    rng = random.Random(family.seed)
    sample: list[str] = []
    for domain in DOMAINS:
        docs = [d["text"] for d in read_documents(corpus_dir / f"{domain}.train.jsonl")]
        rng.shuffle(docs)
        taken = 0
        for text in docs:
            if taken >= _SAMPLE_CHARS_PER_DOMAIN:
                break
            sample.append(text[:20_000])
            taken += len(sample[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=family.vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=True)
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, clean_up_tokenization_spaces=False,
                                   model_max_length=family.max_position_embeddings)
    fast.chat_template = DEMO_CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def encode_corpus(tokenizer: PreTrainedTokenizerFast, corpus_dir: Path, out_dir: Path) -> dict:
    """Tokenise every split into ``{domain}.{split}.npy`` (uint16, documents joined by EOS)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    stats = {}
    for domain in DOMAINS:
        for split in ("train", "heldout"):
            texts = [d["text"] for d in read_documents(corpus_dir / f"{domain}.{split}.jsonl")]
            ids: list[int] = []
            for start in tqdm(range(0, len(texts), 256), desc=f"tokenize {domain}.{split}",
                              unit="batch"):
                for row in tokenizer(texts[start:start + 256], add_special_tokens=False)["input_ids"]:
                    ids.extend(row)
                    ids.append(eos)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(out_dir / f"{domain}.{split}.npy", arr)
            chars = sum(len(t) for t in texts)
            stats[f"{domain}.{split}"] = {"tokens": int(arr.size),
                                          "bytes_per_token": round(chars / max(1, arr.size), 3)}
    (out_dir / "manifest.json").write_text(json.dumps(stats, indent=2))
    return stats
