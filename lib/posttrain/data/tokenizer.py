"""The tokenizer layer: a Hugging Face tokenizer plus chat rendering with loss masks.

The tokenizer's own chat template is the single source of truth. `ChatTokenizer.encode_chat`
renders a conversation once with `apply_chat_template(tokenize=False)` and tokenizes that text
the way `apply_chat_template(tokenize=True)` does (no added BOS/EOS), so the ids we train on are
the ids an inference server (vLLM) builds from the same messages.

Loss masks work for any template, including the real families' templates that carry no
``{% generation %}`` markers (Qwen3, Qwen3.5, Llama 3.x, Gemma 3, Gemma 4, DeepSeek-V3.1,
GPT-OSS's harmony format). Rendering each prefix of the conversation does not work for them:
Qwen3 and harmony drop the reasoning of earlier assistant turns, so a prefix render is not a
prefix of the full render. Instead:

1. Once per tokenizer, small probe conversations reveal the template's *turn layout*: the header
   that opens an assistant turn (``<|im_start|>assistant\\n``, ``<start_of_turn>model\\n``,
   ``<|start|>assistant``, ...; what the generation prompt and rendered turns share, up to a
   token boundary) and the end-of-turn markers that close one (the first special token after
   the content, in a middle turn and in the final one: ``<|im_end|>``, ``<|eot_id|>``,
   ``<end_of_turn>``; harmony closes earlier turns with ``<|end|>`` and the final one with
   ``<|return|>``).
2. Per conversation, the full render R is scanned forward: each assistant message's region runs
   from the end of its header to the end of the first end-of-turn marker. When the header
   follows that marker at once and the next message is not an assistant's, the same message
   goes on (harmony renders a final turn's analysis and final channels as two headed parts,
   ``<|channel|>analysis<|message|>..<|end|><|start|>assistant<|channel|>final<|message|>..``),
   and so does the region, to the next marker. A region must contain the message's (visible)
   content and may not run into another turn, else the row is rejected with a `DataError`.
3. R is tokenized once with offsets; a token is trained when it starts inside a trained region.

So the mask covers exactly what the model generates in a turn: its content, any ``<think>``
block or analysis channel the template renders for it (channel tags included), and the
end-of-turn token; not role headers, not the template's glue after the end-of-turn token (e.g.
the trailing newline), not other roles.
Content that contains a special token's text is rejected: it would render as a control token.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np

from posttrain.errors import ConfigError, DataError

TrainOn = Literal["all_assistant", "last_assistant"]
Message = dict[str, Any]

_PROBE_USER = "Probe question one"
_PROBE_USER_2 = "Probe question two"
_PROBE_ANSWER = "Probe answer text"
_THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class SemanticIdConfig:
    """Semantic-ID tokens: `levels` x `codes_per_level` tokens named by `pattern`."""

    levels: int
    codes_per_level: int
    pattern: str = "<sid_{level}_{code}>"

    def __post_init__(self) -> None:
        if self.levels < 1 or self.codes_per_level < 1:
            raise ConfigError(f"semantic_ids: levels ({self.levels}) and codes_per_level "
                              f"({self.codes_per_level}) must both be at least 1")
        if "{level}" not in self.pattern or "{code}" not in self.pattern:
            raise ConfigError(f"semantic_ids.pattern: {self.pattern!r} must contain both "
                              "'{level}' and '{code}'")

    def tokens(self) -> list[str]:
        """All tokens, level-major: <sid_0_0>, <sid_0_1>, ..., <sid_1_0>, ..."""
        return [self.pattern.format(level=level, code=code)
                for level in range(self.levels) for code in range(self.codes_per_level)]


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer's slice of a recipe config.

    `added_tokens` and the semantic-ID tokens are added as atomic, non-special tokens: each
    encodes as one id, may appear in message content (the model is meant to produce them), and
    survives `decode(skip_special_tokens=True)`.
    """

    path: str
    added_tokens: tuple[str, ...] = ()
    semantic_ids: SemanticIdConfig | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    train_on: TrainOn = "all_assistant"

    def __post_init__(self) -> None:
        if self.train_on not in ("all_assistant", "last_assistant"):
            raise ConfigError(f"tokenizer.train_on: {self.train_on!r} is not one of "
                              "['all_assistant', 'last_assistant']")
        if len(set(self.added_tokens)) != len(self.added_tokens):
            raise ConfigError("tokenizer.added_tokens: contains duplicates")


@dataclass
class Encoded:
    """Token ids and a loss mask of the same length (1 = the loss is taken on this token)."""

    input_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TurnLayout:
    """How the template frames an assistant turn, found by probing it.

    `end_of_turn` closes the final assistant turn (where a generator stops); `turn_ends` are
    all the markers that close one (earlier turns may end differently, as in harmony);
    `turn_start` is the special token that opens every turn, when the header starts with one.
    """

    header: str
    end_of_turn: str
    generation_prompt: str
    turn_ends: tuple[str, ...]
    turn_start: str | None = None


class ChatTokenizer:
    """A Hugging Face fast tokenizer with chat encoding and assistant-only loss masks.

    Built from `cfg.path` with `AutoTokenizer`, or around an existing `tokenizer` (which is then
    modified in place by the config's added tokens).
    """

    def __init__(self, cfg: TokenizerConfig | None = None, *, tokenizer: Any = None):
        if cfg is None and tokenizer is None:
            raise ConfigError("ChatTokenizer needs a TokenizerConfig or a tokenizer")
        if tokenizer is None:
            tokenizer = _load(cfg.path)
        if cfg is None:
            cfg = TokenizerConfig(path=str(getattr(tokenizer, "name_or_path", "")))
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"tokenizer {cfg.path!r}: a fast (Rust) tokenizer is required for "
                              "loss masks (offset mappings); this one is "
                              f"{type(tokenizer).__name__}")
        if not tokenizer.chat_template:
            raise ConfigError(f"tokenizer {cfg.path!r} has no chat template")
        self.cfg = cfg
        self.hf = tokenizer
        self.base_vocab_size = len(tokenizer)
        self.num_added_tokens, self.added_token_ids = self._add_config_tokens()
        specials = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    # --- vocabulary -------------------------------------------------------------------------

    def _add_config_tokens(self) -> tuple[int, list[int]]:
        from tokenizers import AddedToken

        tokens = list(self.cfg.added_tokens)
        if self.cfg.semantic_ids is not None:
            tokens += self.cfg.semantic_ids.tokens()
        if not tokens:
            return 0, []
        clash = [t for t in tokens if t in self.special_tokens]
        if clash:
            raise ConfigError(f"tokenizer.added_tokens: {clash[:3]} are already special tokens")
        added = self.hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
        return added, self.hf.convert_tokens_to_ids(tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included: the size the model's embedding must have."""
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id if self.hf.pad_token_id is not None else self.hf.eos_token_id

    @cached_property
    def special_tokens(self) -> frozenset[str]:
        """Texts of the special (control) tokens; message content may not contain them."""
        specials = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        specials.update(t for t in self.hf.all_special_tokens if t)
        return frozenset(specials)

    @property
    def end_of_turn_token_id(self) -> int | None:
        """The id that ends an assistant turn (a generator's stop token), if it is one token."""
        ids = self.hf.convert_tokens_to_ids([self.layout.end_of_turn])
        return ids[0] if ids and ids[0] != self.hf.unk_token_id else None

    # --- encoding ---------------------------------------------------------------------------

    @cached_property
    def _backend(self) -> Any:
        """The Rust tokenizer, copied once (after the config's added tokens) with truncation
        and padding off. Encoding through it skips transformers' per-call wrapping (about a
        third of prepare's tokenization time) and gives what ``self.hf(text,
        add_special_tokens=False)`` gives (tests/lib/data/test_tokenizer.py)."""
        from tokenizers import Tokenizer

        backend = self.hf.backend_tokenizer
        if backend.truncation is None and backend.padding is None:
            return backend            # transformers sets both per call; it has none to undo
        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
        return backend

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids, without BOS/EOS."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: Sequence[Message], *, train_on: TrainOn | None = None,
                    source: str | None = None, line: int | None = None) -> Encoded:
        """Render `messages` with the chat template and mask all but the trained assistant turns.

        `train_on` overrides the config's ("all_assistant" or "last_assistant"); an assistant
        message with ``"train": false`` is never trained. `source`/`line` locate errors.
        """
        train_on = train_on or self.cfg.train_on
        self._check_messages(messages, source, line)
        trained = _trained_indices(messages, train_on)
        return self._encode(messages, trained, source, line)

    def encode_chats(self, items: Sequence[tuple[Sequence[Message], str | None, int | None]]
                     ) -> list[Encoded | DataError]:
        """`encode_chat` of many conversations ((messages, source, line) each) at once: each is
        rendered and checked on its own (a bad one gives its DataError in its place), then all
        texts are tokenized in one batch call, which the Rust tokenizer spreads over the
        cores."""
        out: list[Encoded | DataError] = []
        texts, spans, where = [], [], []
        for i, (messages, source, line) in enumerate(items):
            try:
                self._check_messages(messages, source, line)
                trained = _trained_indices(messages, self.cfg.train_on)
                text, row_spans = self._render_with_spans(messages, trained, source, line)
            except DataError as err:
                out.append(err)
                continue
            out.append(None)                   # type: ignore[arg-type]  (filled below)
            texts.append(text)
            spans.append(row_spans)
            where.append(i)
        encodings = self._backend.encode_batch(texts, add_special_tokens=False) if texts else []
        for i, enc, row_spans in zip(where, encodings, spans):
            out[i] = self._masked(enc, row_spans)
        return out

    def encode_prompt(self, messages: Sequence[Message], *, source: str | None = None,
                      line: int | None = None, tools: Sequence[dict] | None = None
                      ) -> list[int]:
        """Prompt ids ending in the template's generation prompt (what RL/DPO generate from);
        `tools` (JSON schemas) go to the template as its ``tools`` variable."""
        self._check_messages(messages, source, line)
        text = self._render(messages, source, line, add_generation_prompt=True, tools=tools)
        return self.encode_text(text)

    def encode_continuation(self, messages: Sequence[Message], new_messages: Sequence[Message],
                            *, tools: Sequence[dict] | None = None) -> list[int]:
        """The ids the template puts after the last assistant turn of `messages` when
        `new_messages` (tool results, a user's reply; no assistant message) follow it: the glue
        after that turn's end-of-turn marker, the new messages, and the generation prompt of
        the next assistant turn.

        Token-in/token-out multi-turn rollouts append these ids to the ones the model sampled,
        so the model's own tokens are never decoded and encoded again. The whole conversation is
        rendered and cut right after the last assistant turn, found as the loss masks find it
        (module docstring): a template that renders earlier turns differently once more
        messages follow (Qwen3 drops earlier reasoning after a new user message) changes only
        text before the cut. The cut follows a special token, where the tokenizer splits its
        input anyway, so the suffix gets the ids it has inside the full render.
        """
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("encode_continuation: `messages` must end with an assistant turn")
        if any(m.get("role") == "assistant" for m in new_messages):
            raise ValueError("encode_continuation: `new_messages` may not hold assistant turns")
        conversation = [*messages, *new_messages]
        self._check_messages(conversation, None, None)
        text = self._render(conversation, None, None, add_generation_prompt=True, tools=tools)
        _, _, end = self._assistant_regions(text, conversation, None, None)[-1]
        assert any(text.startswith(t, end - len(t)) for t in self.special_tokens), \
            f"the assistant turn does not end with a special token: {text[end - 20:end]!r}"
        return self.encode_text(text[end:])

    def remove_special_tokens(self, text: str) -> str:
        """`text` without the text of any special token (an environment's observation may
        not smuggle control tokens into the conversation)."""
        return self._special_re.sub("", text) if self._special_re is not None else text

    def encode_preference(self, prompt: Sequence[Message], chosen: Sequence[Message],
                          rejected: Sequence[Message], *, source: str | None = None,
                          line: int | None = None) -> tuple[Encoded, Encoded]:
        """(prompt + chosen, prompt + rejected), each masked to its response's assistant turns."""
        return (self.encode_completion(prompt, chosen, source=source, line=line, name="chosen"),
                self.encode_completion(prompt, rejected, source=source, line=line,
                                       name="rejected"))

    def encode_completion(self, prompt: Sequence[Message], completion: Sequence[Message], *,
                          source: str | None = None, line: int | None = None,
                          name: str = "completion") -> Encoded:
        """prompt + completion, masked to the completion's assistant turns (one side of a
        preference pair, or an unpaired completion); `name` is the field errors name."""
        if not completion or any(m.get("role") != "assistant" for m in completion
                                 if isinstance(m, dict)):
            raise DataError(f"'{name}' must be a non-empty list of assistant messages",
                            file=source, line=line, field=name, reason="invalid_response")
        messages = [*prompt, *completion]
        self._check_messages(messages, source, line)
        trained = {i for i in range(len(prompt), len(messages)) if _is_trained(messages[i])}
        return self._encode(messages, trained, source, line)

    def _encode(self, messages: Sequence[Message], trained: set[int], source: str | None,
                line: int | None) -> Encoded:
        text, spans = self._render_with_spans(messages, trained, source, line)
        return self._masked(self._backend.encode(text, add_special_tokens=False), spans)

    def _render_with_spans(self, messages: Sequence[Message], trained: set[int],
                           source: str | None, line: int | None
                           ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its trained assistant turns."""
        text = self._render(messages, source, line, add_generation_prompt=False)
        regions = self._assistant_regions(text, messages, source, line)
        return text, [(start, end) for i, start, end in regions if i in trained]

    @staticmethod
    def _masked(enc: Any, spans: list[tuple[int, int]]) -> Encoded:
        mask = _mask_from_encoding(enc, spans)
        if mask is None:
            mask = _mask_from_offsets(enc.offsets, spans)
        return Encoded(input_ids=enc.ids, loss_mask=mask)

    # --- rendering and turn regions ----------------------------------------------------------

    def _render(self, messages: Sequence[Message], source: str | None, line: int | None, *,
                add_generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
        from jinja2 import TemplateError

        clean = [{k: v for k, v in m.items() if k != "train"} for m in messages]
        kwargs = dict(self.cfg.chat_template_kwargs)
        if tools:
            kwargs["tools"] = list(tools)
        try:
            return self.hf.apply_chat_template(clean, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               **kwargs)
        except TemplateError as e:
            raise DataError(f"the chat template rejected this conversation: {e}", file=source,
                            line=line, field="messages", reason="template_error") from None

    def _assistant_regions(self, text: str, messages: Sequence[Message], source: str | None,
                           line: int | None) -> list[tuple[int, int, int]]:
        """(message index, start, end) of each assistant turn's generated text in `text`
        (see the module docstring)."""
        layout = self.layout
        regions = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            where = dict(file=source, line=line, field=f"messages[{i}]")
            head = text.find(layout.header, cursor)
            if head < 0:
                raise DataError(f"the rendered conversation has no assistant turn for this message "
                                f"(looked for {layout.header!r})", reason="turn_not_found", **where)
            start = end = head + len(layout.header)
            goes_on = i + 1 == len(messages) or messages[i + 1]["role"] != "assistant"
            while True:
                close = _first_of(text, layout.turn_ends, end)
                if close is None:
                    raise DataError(f"the assistant turn is not closed by any of "
                                    f"{list(layout.turn_ends)}", reason="turn_not_found", **where)
                if layout.turn_start is not None and layout.turn_start in text[end:close[0]]:
                    raise DataError("the assistant turn runs into another turn before it is "
                                    "closed (a tool call this template frames differently?); "
                                    "cannot build its loss mask", reason="turn_mismatch", **where)
                end = close[0] + len(close[1])
                if not (goes_on and text.startswith(layout.header, end)):
                    break
                end += len(layout.header)
            needle = _visible_content(message)
            if needle and needle not in text[start:end]:
                raise DataError("the template did not render this assistant message's content where "
                                "expected; cannot build its loss mask", reason="turn_mismatch", **where)
            regions.append((i, start, end))
            cursor = end
        return regions

    @cached_property
    def layout(self) -> TurnLayout:
        """The template's assistant-turn framing, probed once per tokenizer."""
        return _probe_layout(self._probe_render, self.special_tokens, self._token_ends)

    def _token_ends(self, text: str) -> list[int]:
        """The character offset where each token of `text` ends."""
        return [end for _, end in self._backend.encode(text, add_special_tokens=False).offsets]

    def _probe_render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self._render(messages, None, None, add_generation_prompt=add_generation_prompt)
        except DataError as e:
            raise ConfigError(f"tokenizer {self.cfg.path!r}: cannot probe the chat template with a "
                              f"minimal conversation: {e.detail}") from None

    # --- validation -------------------------------------------------------------------------

    def _check_messages(self, messages: Sequence[Message], source: str | None,
                        line: int | None) -> None:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DataError("expected a non-empty list of messages", file=source, line=line,
                            field="messages", reason="invalid_messages")
        for i, message in enumerate(messages):
            self._check_message(i, message, source, line)

    def _check_message(self, i: int, message: Any, source: str | None, line: int | None) -> None:
        def fail(what: str, name: str, reason: str) -> DataError:
            return DataError(what, file=source, line=line, field=f"messages[{i}]{name}", reason=reason)

        if not isinstance(message, dict):
            raise fail(f"expected a mapping, got {type(message).__name__}", "", "invalid_message")
        if not isinstance(message.get("role"), str):
            raise fail("missing or non-string 'role'", ".role", "invalid_role")
        if not isinstance(message.get("content"), str):
            raise fail("missing or non-string 'content'", ".content", "invalid_content")
        if not isinstance(message.get("train", True), bool):
            raise fail("'train' must be true or false", ".train", "invalid_train")
        for key in ("content", "reasoning_content", "thinking"):
            value = message.get(key)
            if isinstance(value, str) and self._special_re is not None:
                found = self._special_re.search(value)
                if found:
                    raise fail(f"contains the special token {found.group()!r}; it would be read as "
                               "a control token (remove or escape it)", f".{key}",
                               "special_token_in_content")

    # --- persistence ------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write the tokenizer (added tokens and chat template included) in Hugging Face format."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(out_dir))

    def describe(self) -> dict[str, Any]:
        """Facts for the model layer (embedding size) and the run manifest."""
        layout = self.layout
        semantic = self.cfg.semantic_ids
        return {
            "path": self.cfg.path,
            "vocab_size": self.vocab_size,
            "base_vocab_size": self.base_vocab_size,
            "num_added_tokens": self.num_added_tokens,
            "num_semantic_id_tokens": semantic.levels * semantic.codes_per_level if semantic else 0,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "end_of_turn": layout.end_of_turn,
            "end_of_turn_token_id": self.end_of_turn_token_id,
            "turn_ends": list(layout.turn_ends),
            "assistant_header": layout.header,
            "generation_prompt": layout.generation_prompt,
            "chat_template_kwargs": dict(self.cfg.chat_template_kwargs),
            "train_on": self.cfg.train_on,
        }


def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer.path: {path!r} is not a directory with a Hugging Face tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer.path: cannot load a tokenizer from {path!r}: {e}") from None


def _probe_layout(render: Any, special_tokens: frozenset[str],
                  token_ends: Callable[[str], Sequence[int]]) -> TurnLayout:
    """Find the assistant header, end-of-turn markers and generation prompt of a template.

    The header is what the generation prompt, a final assistant turn and a middle assistant turn
    have in common before the content; Qwen3 puts a ``<think>`` block after the header in the
    final turn only, so the common prefix stops at the header proper. It is cut back to a token
    boundary of all three (`_token_aligned`). The end-of-turn markers follow the content of the
    middle and of the final turn.
    """
    user = {"role": "user", "content": _PROBE_USER}
    answer = {"role": "assistant", "content": _PROBE_ANSWER}
    base = render([user])
    prompted = render([user], add_generation_prompt=True)
    if not prompted.startswith(base) or prompted == base:
        raise ConfigError("chat template: add_generation_prompt=True does not append a generation "
                          "prompt to the rendered conversation; cannot locate assistant turns")
    generation_prompt = prompted[len(base):]
    last = render([user, answer])
    middle = render([user, answer, {"role": "user", "content": _PROBE_USER_2}])
    before = [_text_before_answer(base, rendered) for rendered in (last, middle)]
    header = _token_aligned(os.path.commonprefix([generation_prompt, *before]),
                            [generation_prompt, *before], token_ends)
    if not header:
        raise ConfigError("chat template: found no common header that opens assistant turns "
                          f"(generation prompt {generation_prompt!r})")
    after = middle[middle.index(_PROBE_ANSWER) + len(_PROBE_ANSWER):]
    middle_end = _first_special_token(after, special_tokens)
    if middle_end is None:
        raise ConfigError("chat template: no special token closes an assistant turn "
                          f"(text after the content: {after[:40]!r})")
    end_of_turn = _first_special_token(last[last.index(_PROBE_ANSWER) + len(_PROBE_ANSWER):],
                                       special_tokens) or middle_end
    starts = [t for t in special_tokens if header.startswith(t)]
    return TurnLayout(header=header, end_of_turn=end_of_turn, generation_prompt=generation_prompt,
                      turn_ends=tuple(dict.fromkeys((end_of_turn, middle_end))),
                      turn_start=max(starts, key=len) if starts else None)


def _token_aligned(prefix: str, texts: Sequence[str],
                   token_ends: Callable[[str], Sequence[int]]) -> str:
    """`prefix` (a common prefix of `texts`) cut back to the last offset where every text has a
    token boundary.

    Where the generation prompt and the rendered turns part inside a token, the character-wise
    common prefix ends in the middle of it: DeepSeek-V3.1 with ``thinking=True`` prompts
    ``<｜Assistant｜><think>`` but renders turns as ``<｜Assistant｜></think>...``, which share
    ``<｜Assistant｜><``. A turn's region starting there would leave its ``</think>`` token, which
    starts before the region, out of the loss.
    """
    common = set(range(len(prefix) + 1))
    for text in texts:
        common &= {0, len(text), *token_ends(text)}
    return prefix[:max(common)]


def _text_before_answer(base: str, rendered: str) -> str:
    if _PROBE_ANSWER not in rendered:
        raise ConfigError("chat template: a probe assistant message does not appear in the render")
    start = len(os.path.commonprefix([base, rendered]))
    return rendered[start:rendered.index(_PROBE_ANSWER)]


def _first_special_token(text: str, special_tokens: frozenset[str]) -> str | None:
    """The text up to and including the first special token in `text` (glue before it included)."""
    hits = [(text.find(t), -len(t), t) for t in special_tokens if t in text]
    if not hits:
        return None
    position, _, token = min(hits)
    return text[:position + len(token)]


def _first_of(text: str, markers: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest (position, marker) of `markers` in `text` from `start` (longest on a tie)."""
    hits = [(at, -len(m), m) for m in markers if (at := text.find(m, start)) >= 0]
    if not hits:
        return None
    position, _, marker = min(hits)
    return position, marker


def _visible_content(message: Message) -> str:
    """The part of an assistant message every template renders verbatim (modulo trimming).

    Templates may drop the reasoning of earlier turns (Qwen3), so only the text after the last
    ``</think>`` is required to appear.
    """
    return message["content"].rsplit(_THINK_CLOSE, 1)[-1].strip()


def _is_trained(message: Message) -> bool:
    return message.get("role") == "assistant" and message.get("train", True)


def _trained_indices(messages: Sequence[Message], train_on: TrainOn) -> set[int]:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        assistant = assistant[-1:]
    elif train_on != "all_assistant":
        raise ConfigError(f"train_on: {train_on!r} is not one of ['all_assistant', 'last_assistant']")
    return {i for i in assistant if _is_trained(messages[i])}


def _mask_from_encoding(enc: Any, spans: list[tuple[int, int]]) -> list[int] | None:
    """`_mask_from_offsets` from a few lookups per span (`char_to_token` at its ends) instead of
    the offsets of every token; None where a span end falls on a character no token covers."""
    n = len(enc.ids)
    mask = [0] * n
    for start, end in spans:
        first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
        if first is None or last is None:
            return None
        # a character may span several byte-level tokens, all with its offsets
        while first < n and enc.token_to_chars(first)[0] < start:
            first += 1
        while last + 1 < n and enc.token_to_chars(last + 1)[0] < end:
            last += 1
        mask[first:last + 1] = [1] * max(last + 1 - first, 0)
    return mask


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of `spans` (sorted, disjoint)."""
    if not spans:
        return [0] * len(offsets)
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    span_SE = np.asarray(spans, dtype=np.int64)
    k = np.searchsorted(span_SE[:, 1], starts, side="right")      # first span ending after it
    inside = k < len(span_SE)
    k = np.minimum(k, len(span_SE) - 1)
    return ((span_SE[k, 0] <= starts) & inside).astype(np.int8).tolist()
