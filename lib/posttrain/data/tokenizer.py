"""The tokenizer layer: a Hugging Face tokenizer plus chat rendering with loss masks.

The tokenizer's own chat template is the single source of truth. `ChatTokenizer.encode_chat`
renders a conversation once with `apply_chat_template(tokenize=False)` and tokenizes that text
the way `apply_chat_template(tokenize=True)` does (no added BOS/EOS), so the ids we train on are
the ids an inference server (vLLM) builds from the same messages.

Loss masks work for any template, including the real families' templates that carry no
``{% generation %}`` markers (Qwen3, Qwen3.5, Llama 3.x, Gemma 3, Gemma 4, DeepSeek-V3 / V3-0324 /
V3.1 / R1 / R1-Distill, Phi-3 / 3.5, Cohere2, GPT-OSS's harmony format). Rendering each prefix
of the conversation does not work for them: Qwen3 and harmony drop the reasoning of earlier
assistant turns, so a prefix render is not a prefix of the full render. Instead:

1. Once per tokenizer, small probe conversations reveal the template's *turn layout*: the header
   that opens an assistant turn (``<|im_start|>assistant\\n``, ``<start_of_turn>model\\n``,
   ``<|start|>assistant``, ...; what the generation prompt and rendered turns share, up to a
   token boundary) and the end-of-turn markers that close one (the first special token after
   the content, in a middle turn and in the final one: ``<|im_end|>``, ``<|eot_id|>``,
   ``<end_of_turn>``; harmony closes earlier turns with ``<|end|>`` and the final one with
   ``<|return|>``). The generation prompt is what ``add_generation_prompt=True`` appends after a
   user turn; a template may instead render it as part of the user turn (DeepSeek-V3-0324 ends
   every user turn with ``<｜Assistant｜>``) or put it where the conversation would otherwise
   end with EOS (Phi-3's ``<|endoftext|>``). When the token that closes a user turn follows an
   assistant turn's own closing token at once, it closes that turn too and is part of its end
   (Cohere2's ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``: a model that never learns
   ``<|END_OF_TURN_TOKEN|>`` does not stop).
2. Per conversation, the full render R is scanned forward: each assistant message's region runs
   from the end of its header to the end of the first end-of-turn marker. When the header
   follows that marker at once and the next message is not an assistant's, the same message
   goes on (harmony renders a final turn's analysis and final channels as two headed parts,
   ``<|channel|>analysis<|message|>..<|end|><|start|>assistant<|channel|>final<|message|>..``),
   and so does the region, to the next marker. A turn that the next turn's opening token
   follows right after a special token ends with that token (harmony closes a tool call with
   ``<|call|>``, which the tool's ``<|start|>functions.NAME`` turn follows). An assistant message
   that follows a tool result starts where the generation prompt for that point ends, when the
   conversation so far renders as a prefix of R and that prompt has no header of its own
   (DeepSeek's templates go on after ``<｜tool▁outputs▁end｜>``). A tool call whose turn the
   end-of-turn marker does not close before the tool's result (Gemma 4 renders the result
   inside the model's turn) ends where the conversation up to the call, rendered for
   generation, ends, when that is a prefix of R ending with a special token: the token the
   model writes to hand the turn to the tool (Gemma 4's ``<|tool_response>``). A region must
   contain the message's (visible) content and the names of its tool calls, may not run into
   another turn nor over the result of its own tool call, else the row is rejected with a
   `DataError` that says why.
3. R is tokenized once with offsets; a token is trained when it starts inside a trained region.

(Step 1 is `posttrain.data.turn_layout`, steps 2 and 3 are `posttrain.data.turn_regions`.)

So the mask covers exactly what the model generates in a turn: its content, any ``<think>``
block or analysis channel the template renders for it (channel tags included), its tool calls
(harmony's ``to=functions.NAME`` recipient included), and the end-of-turn token; not role
headers nor anything else the generation prompt holds, not the template's glue after the
end-of-turn token (the trailing newline, Phi-3's final ``<|endoftext|>``), not other roles.
Content that contains a special token's text is rejected: it would render as a control token.
A final turn whose reasoning the template drops (DeepSeek-R1's templates keep only the text
after ``</think>``) is rejected when the generation prompt opens a think block: trained on it,
the model would learn to answer without the reasoning its prompts ask for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from posttrain.config.data import SemanticIdConfig, TokenizerConfig, TrainOn
from posttrain.data.chat_messages import check_messages
from posttrain.data.turn_layout import (TurnLayout, ending_special_token, probe_layout,
                                       probe_tool_handover)
from posttrain.data.turn_regions import (THINK_CLOSE, Message, assistant_regions,
                                         mask_from_encoding, mask_from_offsets)
from posttrain.errors import ConfigError, DataError

__all__ = ["ChatTokenizer", "Encoded", "Message", "SemanticIdConfig", "TokenizerConfig"]


@dataclass
class RenderedChats:
    """Conversations rendered by `ChatTokenizer.render_chats`, not yet tokenized: per item,
    the index of its text in `texts` (and of its trained turns' character spans in `spans`)
    or the DataError that refused it."""

    items: list[int | DataError] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    spans: list[list[tuple[int, int]]] = field(default_factory=list)


@dataclass
class Encoded:
    """Token ids and a loss mask of the same length (1 = the loss is taken on this token)."""

    input_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


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
        """The id of the special token an assistant turn ends with (a generator's stop token:
        ``<|END_OF_TURN_TOKEN|>`` of Cohere2's ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``)."""
        return self._token_id(ending_special_token(self.layout.end_of_turn, self.special_tokens))

    @cached_property
    def tool_handover_token_id(self) -> int | None:
        """The id of the special token a turn ends with when it hands over to a tool, where the
        template does not end such a turn with its end-of-turn token (Gemma 4's
        ``<|tool_response>``; `posttrain.data.turn_layout.probe_tool_handover`); else None."""
        return self._token_id(probe_tool_handover(self._render_or_none, self.layout,
                                                  self.special_tokens, self.hf.eos_token))

    def _token_id(self, token: str | None) -> int | None:
        """The id of one token of the vocabulary (None for None or an unknown token)."""
        ids = self.hf.convert_tokens_to_ids([token]) if token else []
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
        check_messages(messages, self._special_re, source, line)
        trained = _trained_indices(messages, train_on)
        return self._encode(messages, trained, source, line)

    def encode_chats(self, items: Sequence[tuple[Sequence[Message], str | None, int | None]]
                     ) -> list[Encoded | DataError]:
        """`encode_chat` of many conversations ((messages, source, line) each) at once: each is
        rendered and checked on its own (a bad one gives its DataError in its place), then all
        texts are tokenized in one batch call, which the Rust tokenizer spreads over the
        cores."""
        rendered = self.render_chats(items)
        return self.mask_chats(rendered, self.tokenize_texts(rendered.texts))

    def render_chats(self, items: Sequence[tuple[Sequence[Message], str | None, int | None]]
                     ) -> RenderedChats:
        """The first half of `encode_chats`, in Python: each conversation checked and rendered,
        with the character spans of its trained turns, or its DataError."""
        out = RenderedChats()
        for messages, source, line in items:
            try:
                check_messages(messages, self._special_re, source, line)
                trained = _trained_indices(messages, self.cfg.train_on)
                text, row_spans = self._render_with_spans(messages, trained, source, line)
            except DataError as err:
                out.items.append(err)
                continue
            out.items.append(len(out.texts))
            out.texts.append(text)
            out.spans.append(row_spans)
        return out

    def tokenize_texts(self, texts: Sequence[str]) -> list[Any]:
        """The tokenizer's encodings of `texts` (no special tokens added), in one batch call.
        The Rust tokenizer releases the GIL for it, so a thread may run it while Python
        renders the next batch (`posttrain.data.encode.RecordEncoder.encode_batches`)."""
        return self._backend.encode_batch(list(texts), add_special_tokens=False) if texts else []

    def mask_chats(self, rendered: RenderedChats, encodings: Sequence[Any]
                   ) -> list[Encoded | DataError]:
        """The second half of `encode_chats`: each rendered conversation's ids and loss mask
        from its encoding (`tokenize_texts` of `rendered.texts`), errors in their places."""
        return [item if isinstance(item, DataError)
                else self._masked(encodings[item], rendered.spans[item])
                for item in rendered.items]

    def encode_prompt(self, messages: Sequence[Message], *, source: str | None = None,
                      line: int | None = None, tools: Sequence[dict] | None = None
                      ) -> list[int]:
        """Prompt ids ending in the template's generation prompt (what RL/DPO generate from);
        `tools` (JSON schemas) go to the template as its ``tools`` variable."""
        check_messages(messages, self._special_re, source, line)
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
        input anyway, so the suffix gets the ids it has inside the full render; it is tokenized
        from that special token on, whose id is then dropped, so a token that takes the
        whitespace after it (Phi-3's ``<|end|>``, ``rstrip``) keeps it here too.
        """
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("encode_continuation: `messages` must end with an assistant turn")
        if any(m.get("role") == "assistant" for m in new_messages):
            raise ValueError("encode_continuation: `new_messages` may not hold assistant turns")
        conversation = [*messages, *new_messages]
        check_messages(conversation, self._special_re, None, None)
        text = self._render(conversation, None, None, add_generation_prompt=True, tools=tools)
        _, _, end = self._assistant_regions(text, conversation, None, None, tools)[-1]
        token = ending_special_token(text[:end], self.special_tokens)
        assert token is not None, \
            f"the assistant turn does not end with a special token: {text[end - 20:end]!r}"
        ids = self.encode_text(text[end - len(token):])
        assert ids[0] == self.hf.convert_tokens_to_ids(token), (token, ids[:3])
        return ids[1:]

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
        check_messages(messages, self._special_re, source, line)
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
        last, start, end = regions[-1] if regions else (None, 0, 0)
        if last == len(messages) - 1 and last in trained and self._prompts_reasoning:
            reasoning = _reasoning(messages[last])
            if reasoning and reasoning not in text[start:end]:
                raise DataError(
                    "the chat template drops the reasoning of this final assistant turn (it "
                    "keeps only the text after '</think>', as DeepSeek-R1's and V3.1's templates "
                    "do) although its generation prompt "
                    f"{self.layout.generation_prompt!r} opens a think block: trained on it, the "
                    "model would learn to answer without reasoning. Remove the reasoning from "
                    "the data, or give the tokenizer a chat template that renders it in the "
                    "final turn (TRL's deepseek_r1_distill_training.jinja does)", file=source,
                    line=line, field=f"messages[{last}]", reason="reasoning_dropped")
        return text, [(start, end) for i, start, end in regions if i in trained]

    @staticmethod
    def _masked(enc: Any, spans: list[tuple[int, int]]) -> Encoded:
        mask = mask_from_encoding(enc, spans)
        if mask is None:
            mask = mask_from_offsets(enc.offsets, spans)
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
        except TypeError as e:
            # a value of the wrong type for this template: DeepSeek's templates concatenate
            # tool-call arguments (a JSON string), Qwen3.5's iterate them (a mapping)
            raise DataError(f"the chat template failed on this conversation ({e}): a field has "
                            "a type this template does not take (tool-call arguments as a JSON "
                            "string or as a mapping?)", file=source, line=line, field="messages",
                            reason="template_error") from None

    def _assistant_regions(self, text: str, messages: Sequence[Message], source: str | None,
                           line: int | None, tools: Sequence[dict] | None = None
                           ) -> list[tuple[int, int, int]]:
        """(message index, start, end) of each assistant turn's generated text in `text`, the
        render of `messages` (with `tools`; see the module docstring)."""
        def render_prompt(prefix: Sequence[Message]) -> str:
            return self._render(prefix, None, None, add_generation_prompt=True, tools=tools)

        return assistant_regions(text, messages, self.layout, self.special_tokens,
                                 render_prompt, source, line)

    @cached_property
    def layout(self) -> TurnLayout:
        """The template's assistant-turn framing, probed once per tokenizer."""
        return probe_layout(self._probe_render, self.special_tokens, self._token_ends)

    @cached_property
    def _prompts_reasoning(self) -> bool:
        """Whether the generation prompt opens a think block it does not close."""
        prompt = self.layout.generation_prompt
        return prompt.rfind("<think>") > prompt.rfind(THINK_CLOSE)

    def _token_ends(self, text: str) -> list[int]:
        """The character offset where each token of `text` ends."""
        return [end for _, end in self._backend.encode(text, add_special_tokens=False).offsets]

    def _render_or_none(self, messages: list[Message]) -> str | None:
        """`messages` rendered with the generation prompt, or None where the template refuses
        them."""
        try:
            return self._render(messages, None, None, add_generation_prompt=True)
        except DataError:
            return None

    def _probe_render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self._render(messages, None, None, add_generation_prompt=add_generation_prompt)
        except DataError as e:
            raise ConfigError(f"tokenizer {self.cfg.path!r}: cannot probe the chat template with a "
                              f"minimal conversation: {e.detail}") from None

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


def _reasoning(message: Message) -> str:
    """The reasoning an assistant message carries: its ``reasoning_content`` or ``thinking``
    field, or the text of a ``<think>`` block that ends in ``</think>`` in its content."""
    for key in ("reasoning_content", "thinking"):
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    content = message["content"]
    if THINK_CLOSE not in content:
        return ""
    return content.split(THINK_CLOSE)[0].split("<think>")[-1].strip()


def _is_trained(message: Message) -> bool:
    return message.get("role") == "assistant" and message.get("train", True)


def _trained_indices(messages: Sequence[Message], train_on: TrainOn) -> set[int]:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        assistant = assistant[-1:]
    elif train_on != "all_assistant":
        raise ConfigError(f"train_on: {train_on!r} is not one of ['all_assistant', 'last_assistant']")
    return {i for i in assistant if _is_trained(messages[i])}
