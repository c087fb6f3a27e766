"""Random-initialised checkpoints of real architectures and vocabularies, made in the tests.

Each pair is a target and a draft model of one published architecture, with its real vocabulary
size, its attention layout (grouped-query heads, Qwen2's q/k/v biases, Llama-3's rope scaling,
tied or untied embeddings) and its context length, but two layers and a hidden size of 256 so
that a CPU runs them in seconds:

- ``llama3``: Llama-3.2 style, 128256 tokens, 4 query heads per key/value head, llama3 rope
  scaling, a 131072-token context, tied embeddings;
- ``qwen2``: Qwen2.5 style, a 152064-row target (7B's padding) and a 151936-row draft (0.5B's)
  for one tokenizer, q/k/v biases, 2 query heads per key/value head;
- ``mistral``: Mistral v0.3 style, 32768 tokens, 4 query heads per key/value head, no sliding
  window.

A random draft model agrees with a random target almost never, so each draft is the target's
own weights with Gaussian noise of 10% of each layer matrix's scale (measured: about 2.2 tokens
per step at k = 4), and cut to the draft's vocabulary: speculation then both accepts and
rejects. Tokenizers are synthetic word-level ones of the real sizes (``tokenizer``), or byte-level
BPE ones where text must survive loading (``bpe_tokenizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig,
                          PreTrainedTokenizerFast, Qwen2Config)

NOISE = 0.1
"""The draft's layer matrices: the target's plus noise of this share of their std."""


@dataclass(frozen=True)
class Arch:
    """One published architecture, cut to two layers."""

    config: type[PretrainedConfig]
    vocab: int
    """The target's vocabulary rows."""
    draft_vocab: int
    """The draft's vocabulary rows (a different padding of the same tokenizer)."""
    tokens: int
    """Tokens of the tokenizer (ids 0 .. tokens - 1): at most both vocabularies."""
    options: dict = field(default_factory=dict)


SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
             head_dim=64, rms_norm_eps=1e-5)
ARCHS = {
    "llama3": Arch(LlamaConfig, 128256, 128256, 128256, dict(
        num_key_value_heads=1, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": Arch(Qwen2Config, 152064, 151936, 151665, dict(
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_theta=1000000.0, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151645)),
    "mistral": Arch(MistralConfig, 32768, 32768, 32768, dict(
        num_key_value_heads=1, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_theta=1000000.0, sliding_window=None, bos_token_id=1, eos_token_id=2)),
}


def make_pair(arch: str, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``root/<arch>/target`` and ``root/<arch>/draft`` (bf16 safetensors, loaded in the
    dtype a test asks for) and return their paths."""
    spec = ARCHS[arch]
    out = root / arch
    target_dir, draft_dir = out / "target", out / "draft"
    if (draft_dir / "config.json").exists():
        return target_dir, draft_dir
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(
        spec.config(vocab_size=spec.vocab, **SMALL, **spec.options), dtype=torch.float32)
    target.to(torch.bfloat16).save_pretrained(target_dir)
    state = target.state_dict()
    draft = AutoModelForCausalLM.from_config(
        spec.config(vocab_size=spec.draft_vocab, **SMALL, **spec.options), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            w = state[name][:p.shape[0]] if name.endswith(("embed_tokens.weight",
                                                            "lm_head.weight")) else state[name]
            if ".layers." in name and w.dim() == 2:
                w = w + torch.randn(w.shape, generator=gen) * w.std() * NOISE
            p.copy_(w)
    draft.to(torch.bfloat16).save_pretrained(draft_dir)
    return target_dir, draft_dir


def tokenizer(size: int, shuffle_seed: int | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``size`` tokens ('w0', 'w1', ... and '<eos>' last); with
    ``shuffle_seed`` the same words under other ids (a tokenizer that splits text alike but
    numbers it differently: incompatible)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(size - 1)] + ["<eos>"]
    ids = list(range(size)) if shuffle_seed is None else shuffled_ids(size, shuffle_seed)
    tok = Tokenizer(models.WordLevel(dict(zip(words, ids)), unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")


def shuffled_ids(size: int, shuffle_seed: int) -> list[int]:
    """The id of each word of ``tokenizer(size, shuffle_seed)``, in the order of the unshuffled
    ids ('<eos>' keeps the last)."""
    perm = torch.randperm(size - 1, generator=torch.Generator().manual_seed(shuffle_seed))
    return perm.tolist() + [size - 1]


def bpe_tokenizer(size: int, shuffle_seed: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``size`` tokens in Qwen2's pipeline (its pre-tokenizer,
    decoder and normalizer): the 256 byte symbols, then words of 1 to 4 letters with their
    leading space ('Ġa', 'Ġb', ..., 'Ġaa', ...: ' qx' is one token), each the merge of its
    prefix and its last letter, and '<eos>' last; with ``shuffle_seed`` the same tokens under
    other ids (``shuffled_ids``). Unlike ``tokenizer``'s, its text survives ``AutoTokenizer``,
    which loads a Qwen2 checkpoint's tokenizer into Qwen2's pipeline: decoding and encoding
    text give the same tokens after loading as before."""
    from itertools import product
    from string import ascii_lowercase

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    words: list[str] = []
    for n in range(1, 5):  # shorter first: every word's prefix is a token before it
        words += ["Ġ" + "".join(w) for w in product(ascii_lowercase, repeat=n)]
        if len(alphabet) + len(words) >= size - 1:
            break
    tokens = alphabet + words[:size - 1 - len(alphabet)] + ["<eos>"]
    ids = list(range(size)) if shuffle_seed is None else shuffled_ids(size, shuffle_seed)
    merges = [(w[:-1], w[-1]) for w in tokens[len(alphabet):-1] if len(w) > 1]
    tok = Tokenizer(models.BPE(dict(zip(tokens, ids)), merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                                   r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def renumber(src: Path, dst: Path, size: int, shuffle_seed: int, make=bpe_tokenizer) -> Path:
    """Write to ``dst`` the checkpoint at ``src`` with its embedding and output rows moved to the
    ids ``make(size, shuffle_seed)`` (``tokenizer`` or ``bpe_tokenizer``) gives their tokens,
    with that tokenizer: the same model under another numbering of the same tokens (it predicts
    what ``src`` predicts, in other ids)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    to = torch.tensor(shuffled_ids(size, shuffle_seed))
    with torch.no_grad():
        rows = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        for w in {id(w): w for w in rows}.values():  # once when they are tied
            moved = w.clone()
            moved[to] = w[:size]
            w.copy_(moved)
    model.to(torch.bfloat16).save_pretrained(dst)
    make(size, shuffle_seed).save_pretrained(dst)
    return dst


def prompts(n: int, vocab: int, seed: int = 0, lengths: tuple[int, ...] = (5, 17, 40, 9, 64, 23),
            ) -> list[tuple[int, ...]]:
    """``n`` random prompts of mixed lengths over ids < ``vocab``."""
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=gen).tolist())
            for i in range(n)]
