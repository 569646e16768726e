"""An assistant turn's framing in a chat template (its *turn layout*), found by probing the
template with small conversations; `posttrain.data.tokenizer` builds loss masks from it.

The header that opens an assistant turn is what the generation prompt and rendered turns share
before the content, up to a token boundary; the end-of-turn markers are the first special token
after the content, in a middle turn and in the final one, followed by the token that closes a
user turn where that comes at once (Cohere2). See `probe_layout` and the module docstring of
`posttrain.data.tokenizer`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.errors import ConfigError

_PROBE_USER = "Probe question one"
_PROBE_USER_2 = "Probe question two"
_PROBE_ANSWER = "Probe answer text"


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


def probe_layout(render: Any, special_tokens: frozenset[str],
                 token_ends: Callable[[str], Sequence[int]]) -> TurnLayout:
    """Find the assistant header, end-of-turn markers and generation prompt of a template.

    The header is what the generation prompt, a final assistant turn and a middle assistant turn
    have in common before the content; Qwen3 puts a ``<think>`` block after the header in the
    final turn only, so the common prefix stops at the header proper. It is cut back to a token
    boundary of all three (`_token_aligned`). The end-of-turn markers follow the content of the
    middle and of the final turn; the token that closes a user turn is part of them where it
    follows at once (`_with_closer`).
    """
    user = {"role": "user", "content": _PROBE_USER}
    answer = {"role": "assistant", "content": _PROBE_ANSWER}
    base = render([user])
    context, generation_prompt = _split_generation_prompt(
        base, render([user], add_generation_prompt=True), token_ends)
    last = render([user, answer])
    middle = render([user, answer, {"role": "user", "content": _PROBE_USER_2}])
    before = [_text_before_answer(context, rendered) for rendered in (last, middle)]
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
    after_last = last[last.index(_PROBE_ANSWER) + len(_PROBE_ANSWER):]
    end_of_turn = _first_special_token(after_last, special_tokens) or middle_end
    closer = _first_special_token(base[base.index(_PROBE_USER) + len(_PROBE_USER):],
                                  special_tokens)
    if closer not in special_tokens or header.startswith(closer):
        closer = None
    middle_end = _with_closer(middle_end, after, closer)
    end_of_turn = _with_closer(end_of_turn, after_last, closer)
    starts = [t for t in special_tokens if header.startswith(t)]
    return TurnLayout(header=header, end_of_turn=end_of_turn, generation_prompt=generation_prompt,
                      turn_ends=tuple(dict.fromkeys((end_of_turn, middle_end))),
                      turn_start=max(starts, key=len) if starts else None)


def probe_tool_handover(render: Callable[[list[dict[str, Any]]], str | None], layout: TurnLayout,
                        special_tokens: frozenset[str], eos_token: str | None) -> str | None:
    """The special token a template ends a tool-calling turn with, where that is not how it
    ends other turns: Gemma 4 renders ``<|tool_response>`` after a call that has no result yet
    (a generator stops there, and the result follows inside the same turn). Found by rendering
    a probe call with the generation prompt (`render`, None where the template refuses it);
    None for a template whose calls end their turn as any other (its end-of-turn marker, or a
    new header after it), or that takes no calls."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "probe_tool", "arguments": {}}}
    text = render([{"role": "user", "content": _PROBE_USER},
                   {"role": "assistant", "content": "", "tool_calls": [call]}])
    token = ending_special_token(text, special_tokens) if text else None
    if token is None or "probe_tool" not in text or token in layout.generation_prompt \
            or token in layout.turn_ends or token == eos_token:
        return None
    return token


def _split_generation_prompt(base: str, prompted: str, token_ends: Callable[[str], Sequence[int]]
                             ) -> tuple[str, str]:
    """(the conversation before the generation prompt, the generation prompt), from the render
    of one user turn without (`base`) and with (`prompted`) ``add_generation_prompt``.

    Most templates append the prompt to `base`. DeepSeek-V3-0324 ends every user turn with
    ``<｜Assistant｜>`` and appends nothing: the prompt is what follows the user's text. Phi-3 ends a
    conversation without the prompt with EOS (``<|endoftext|>``) and puts the prompt instead: it
    is what follows their common part, cut back to a token boundary.
    """
    if prompted.startswith(base) and prompted != base:
        return base, prompted[len(base):]
    if prompted == base:
        cut = base.index(_PROBE_USER) + len(_PROBE_USER)
    else:
        common = os.path.commonprefix([base, prompted])
        cut = len(_token_aligned(common, [base, prompted], token_ends))
    if cut < base.index(_PROBE_USER) + len(_PROBE_USER) or cut == len(prompted):
        raise ConfigError("chat template: add_generation_prompt=True renders no generation prompt "
                          f"after a user turn (with it: {prompted[-60:]!r}; without: "
                          f"{base[-60:]!r}); cannot locate assistant turns")
    return prompted[:cut], prompted[cut:]


def _with_closer(end: str, after: str, closer: str | None) -> str:
    """`end` (what closes an assistant turn in `after`) followed by `closer` (the token that closes
    a user turn) where the template puts that right after it (Cohere2: ``<|END_RESPONSE|>`` then
    ``<|END_OF_TURN_TOKEN|>``)."""
    if closer is not None and not end.endswith(closer) and after.startswith(end + closer):
        return end + closer
    return end


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


def _text_before_answer(context: str, rendered: str) -> str:
    if _PROBE_ANSWER not in rendered:
        raise ConfigError("chat template: a probe assistant message does not appear in the render")
    start = len(os.path.commonprefix([context, rendered]))
    return rendered[start:rendered.index(_PROBE_ANSWER)]


def _first_special_token(text: str, special_tokens: frozenset[str]) -> str | None:
    """The text up to and including the first special token in `text` (glue before it included)."""
    hits = [(text.find(t), -len(t), t) for t in special_tokens if t in text]
    if not hits:
        return None
    position, _, token = min(hits)
    return text[:position + len(token)]


def ending_special_token(text: str, special_tokens: frozenset[str]) -> str | None:
    """The (longest) special token `text` ends with, if any."""
    ends = [t for t in special_tokens if text.endswith(t)]
    return max(ends, key=len) if ends else None
