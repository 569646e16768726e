"""The shared inputs of the posttrain-vs-TRL bench (`bench/vs_trl.py`): a tokenizer, a model and
data that both sides read from disk, so they train the same weights on the same tokens.

* **Text.** Pseudo-words made of syllables (a Zipf-distributed inventory of 30,000), so a
  byte-level BPE finds enough merges for an 8,192-token vocabulary (the bundled chat data runs
  out of merges at ~3.2k).
* **Tokenizer.** Byte-level BPE, vocabulary 8,192, trained on that text by
  `tools/make_assets.make_tokenizer` (the bundled tokenizer's recipe: Qwen-style `<|im_start|>` /
  `<|im_end|>` chat template with `{% generation %}` markers).
* **Model.** A random Qwen3-shaped checkpoint, hidden 256, 4 layers, 4 query / 2 key-value heads of
  64, MLP 768, untied head: 7.3 M parameters, written by transformers itself.
* **Chat rows** (SFT, prepare): 4,000 two-message conversations whose token lengths are lognormal
  with median 156 and 99th percentile ~2,046 (sigma = ln(2046/156) / 2.326), cut at 2,048; the
  user turn holds 20-50% of the words.
* **Preference rows** (DPO): a prompt, and chosen / rejected answers of the same length
  distribution (shorter: median 96).
* **Prompt rows** (GRPO): one user message each.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 8192
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   tie_word_embeddings=False)

_ONSETS = ["", "b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "kr", "l",
           "m", "n", "p", "pl", "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "nd", "st", "x", "ck", "ng"]


def words(n: int = 30_000, seed: int = 0) -> list[str]:
    """`n` distinct pseudo-words of 1-4 syllables, most frequent first."""
    rng = np.random.default_rng(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        k = int(rng.choice([1, 2, 2, 3, 3, 4]))
        out["".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                    for _ in range(k))] = None
    return list(out)


class Text:
    """Zipf-sampled sentences over the word inventory, with some punctuation and numbers."""

    def __init__(self, seed: int = 0):
        self.words = words(seed=seed)
        ranks = np.arange(1, len(self.words) + 1)
        self.p = 1.0 / ranks ** 1.05
        self.p /= self.p.sum()
        self.rng = np.random.default_rng(seed + 1)

    def sentence(self, n_words: int) -> str:
        idx = self.rng.choice(len(self.words), size=n_words, p=self.p)
        parts = []
        for i, w in enumerate(idx):
            word = self.words[w]
            if i % 11 == 0:
                word = word.capitalize()
            parts.append(word)
            if i % 13 == 12:
                parts[-1] += ","
            if i % 29 == 28:
                parts.append(str(int(self.rng.integers(0, 10_000))))
        return " ".join(parts) + "."


def build_tokenizer(out_dir: Path, seed: int = 0) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_assets import make_tokenizer
    text = Text(seed)
    corpus = [text.sentence(int(text.rng.integers(20, 200))) for _ in range(12_000)]
    make_tokenizer(corpus, out_dir, vocab_size=VOCAB)
    return out_dir


def build_model(tokenizer_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), max_position_embeddings=4096,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.pad_token_id, **MODEL_SHAPE)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def _lengths(rng: np.random.Generator, n: int, median: float, p99: float, cap: int) -> np.ndarray:
    sigma = math.log(p99 / median) / 2.326
    return np.clip(rng.lognormal(math.log(median), sigma, n), 24, cap).astype(int)


def write_data(tokenizer_dir: Path, out_dir: Path, *, chats: int = 4000, pairs: int = 512,
               prompts: int = 512, seed: int = 0) -> dict[str, Path]:
    """chat.jsonl, preference.jsonl and prompts.jsonl under `out_dir`; returns their paths."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = Text(seed + 7)
    probe = text.sentence(4000)
    per_word = len(tok(probe)["input_ids"]) / 4000
    rng = np.random.default_rng(seed)
    overhead = 12                                  # the template's tokens of two messages

    def exchange(n_tokens: int) -> tuple[str, str]:
        body = max(int((n_tokens - overhead) / per_word), 4)
        n_user = max(2, int(body * rng.uniform(0.2, 0.5)))
        return text.sentence(n_user), text.sentence(max(body - n_user, 2))

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"{k}.jsonl" for k in ("chat", "preference", "prompts")}
    with paths["chat"].open("w") as f:
        for n in _lengths(rng, chats, 156, 2046, 2048):
            user, answer = exchange(int(n))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    with paths["preference"].open("w") as f:
        for n in _lengths(rng, pairs, 96, 700, 1000):
            user, chosen = exchange(int(n))
            _, rejected = exchange(int(n * rng.uniform(0.6, 1.4)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": user}],
                                "chosen": [{"role": "assistant", "content": chosen}],
                                "rejected": [{"role": "assistant", "content": rejected}]})
                    + "\n")
    with paths["prompts"].open("w") as f:
        for _ in range(prompts):
            f.write(json.dumps({"prompt": [{"role": "user", "content": text.sentence(
                int(rng.integers(8, 24)))}], "answer": "0"}) + "\n")
    return paths
