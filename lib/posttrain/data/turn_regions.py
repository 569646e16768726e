"""Where the assistant turns lie in a rendered conversation, and which tokens that trains:
steps 2 and 3 of the loss masks that `posttrain.data.tokenizer.ChatTokenizer` builds (its
module docstring tells the whole method; step 1, the template's `TurnLayout`, is
`posttrain.data.turn_layout`).

* `assistant_regions` scans the full render forward and gives each assistant message's
  generated text as a character span: from the end of its header (or, after a tool result the
  template does not follow with a header, from the end of the generation prompt for that
  point) to the end of its end-of-turn marker, going on through harmony's second headed part;
  a tool call that marker does not close before the tool's result (Gemma 4) ends where the
  conversation up to the call, rendered for generation, ends with a special token. A span
  that misses the message's content or tool calls, runs into another turn, or holds the
  result of its own tool call is refused with a `DataError` that says why.
* `mask_from_encoding` / `mask_from_offsets` turn the trained spans into a token mask: a token
  is trained when its first character lies inside a span.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posttrain.data.turn_layout import TurnLayout, ending_special_token
from posttrain.errors import DataError

Message = dict[str, Any]

THINK_CLOSE = "</think>"


def assistant_regions(text: str, messages: Sequence[Message], layout: TurnLayout,
                      special_tokens: frozenset[str],
                      render_prompt: Callable[[Sequence[Message]], str],
                      source: str | None, line: int | None) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant turn's generated text in `text`, the
    render of `messages` (see the module docstring). `render_prompt` renders a conversation
    with the generation prompt (and the tools `text` was rendered with), raising `DataError`
    where the template refuses it."""
    regions = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        where = dict(file=source, line=line, field=f"messages[{i}]")
        start = _turn_start(text, messages, i, cursor, layout.header, render_prompt, where)
        goes_on = i + 1 == len(messages) or messages[i + 1]["role"] != "assistant"
        end = _generated_end(text, messages, i, start, goes_on, layout, special_tokens,
                             render_prompt, where)
        _check_turn(text, messages, i, start, end, where)
        regions.append((i, start, end))
        cursor = end
    return regions


def _turn_start(text: str, messages: Sequence[Message], i: int, cursor: int, header: str,
                render_prompt: Callable[[Sequence[Message]], str], where: dict[str, Any]) -> int:
    """Where assistant message i's generated text starts: after its header, or, after a tool
    result the template does not follow with a header, where the generation prompt for that
    point ends (the conversation so far rendered with it is then a prefix of `text`)."""
    if i and messages[i - 1]["role"] == "tool":
        try:
            prompt = render_prompt(messages[:i])
        except DataError:
            prompt = ""
        if cursor <= len(prompt) and text.startswith(prompt) and \
                header not in text[cursor:len(prompt)]:
            return len(prompt)
    head = text.find(header, cursor)
    if head < 0:
        raise DataError(f"the rendered conversation has no assistant turn for this message "
                        f"(looked for {header!r})", reason="turn_not_found", **where)
    return head + len(header)


def _turn_end(text: str, start: int, goes_on: bool, layout: TurnLayout,
              special_tokens: frozenset[str], where: dict[str, Any]) -> int:
    """The end of the turn whose generated text starts at `start`."""
    end = start
    while True:
        close = _first_of(text, layout.turn_ends, end)
        opens = text.find(layout.turn_start, end) if layout.turn_start is not None else -1
        if 0 <= opens and (close is None or opens < close[0]):
            # another role's turn opens first: this one ended with the special token before it
            if opens > start and not text.startswith(layout.header, opens) and \
                    ending_special_token(text[:opens], special_tokens):
                return opens
            raise DataError("the assistant turn runs into another turn before it is closed "
                            "(a tool call this template frames differently?); cannot build "
                            "its loss mask", reason="turn_mismatch", **where)
        if close is None:
            raise DataError(f"the assistant turn is not closed by any of "
                            f"{list(layout.turn_ends)}", reason="turn_not_found", **where)
        end = close[0] + len(close[1])
        if not (goes_on and text.startswith(layout.header, end)):
            return end
        end += len(layout.header)


def _generated_end(text: str, messages: Sequence[Message], i: int, start: int, goes_on: bool,
                   layout: TurnLayout, special_tokens: frozenset[str],
                   render_prompt: Callable[[Sequence[Message]], str],
                   where: dict[str, Any]) -> int:
    """Where assistant message i's generated text ends: at its end-of-turn marker
    (`_turn_end`), or, for a tool call whose turn that marker does not close before the tool's
    result (or closes nowhere), where the model hands the turn to the tool (`_call_end`)."""
    try:
        end = _turn_end(text, start, goes_on, layout, special_tokens, where)
    except DataError:
        call_end = _tool_calls(messages[i]) and _call_end(
            text, messages, i, start, len(text) + 1, layout, special_tokens, render_prompt)
        if not call_end:
            raise
        return call_end
    if _holds_own_result(text, messages, i, start, end):
        return _call_end(text, messages, i, start, end, layout, special_tokens,
                         render_prompt) or end
    return end


def _holds_own_result(text: str, messages: Sequence[Message], i: int, start: int,
                      end: int) -> bool:
    """Whether assistant message i's span holds the result of its own tool call (the tool
    message after it), which is not an argument of the call."""
    calls = _tool_calls(messages[i])
    result = messages[i + 1] if calls and i + 1 < len(messages) else {}
    output = result.get("content", "") if result.get("role") == "tool" else ""
    output = output.strip() if isinstance(output, str) else ""
    return bool(output) and output in text[start:end] and \
        not any(output in arguments for _, arguments in calls)


def _call_end(text: str, messages: Sequence[Message], i: int, start: int, end: int,
              layout: TurnLayout, special_tokens: frozenset[str],
              render_prompt: Callable[[Sequence[Message]], str]) -> int | None:
    """Where the generated text of tool-calling message i ends in a template that renders the
    tool's result inside the same turn (Gemma 4): where the conversation up to the call ends,
    rendered for generation, when that render is a prefix of `text` that ends with a special
    token before `end`, and no header lies between `start` and there. That token is what the
    model writes to hand the turn to the tool (Gemma 4 ends a call with ``<|tool_response>``,
    which its template renders after a call that has no result yet). None otherwise."""
    try:
        prompt = render_prompt(messages[:i + 1])
    except DataError:
        return None
    if start < len(prompt) < end and text.startswith(prompt) and \
            layout.header not in text[start:len(prompt)] and \
            ending_special_token(prompt, special_tokens):
        return len(prompt)
    return None


def _check_turn(text: str, messages: Sequence[Message], i: int, start: int, end: int,
                where: dict[str, Any]) -> None:
    """Reject a region that misses the message's content or tool calls, or that holds the
    result of its own tool call."""
    message, region = messages[i], text[start:end]
    calls = _tool_calls(message)
    needle = _visible_content(message)
    # harmony drops a tool call's content (its analysis) once a final answer follows
    if needle and needle not in region and not (calls and needle not in text):
        raise DataError("the template did not render this assistant message's content where "
                        "expected; cannot build its loss mask", reason="turn_mismatch", **where)
    for name, _ in calls:
        if name not in region:
            raise DataError(f"the template did not render this message's tool call {name!r} "
                            "inside its turn (templates without tool calls, as Phi-3's, drop "
                            "them; DeepSeek-R1-Distill's renders them only when content is "
                            "null); cannot build its loss mask", reason="turn_mismatch",
                            **where)
    if _holds_own_result(text, messages, i, start, end):
        output = messages[i + 1]["content"].strip()
        raise DataError(f"the template does not close this tool-call turn before the tool's "
                        f"result {output[:40]!r}, which would fall inside its loss mask (Gemma "
                        "4 renders the text of a message that also calls a tool after the "
                        "tool's results: give the text its own message after them; "
                        "DeepSeek-R1-Distill's template leaves a single tool call unclosed); "
                        "cannot build its loss mask", reason="turn_mismatch", **where)


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
    return message["content"].rsplit(THINK_CLOSE, 1)[-1].strip()


def _tool_calls(message: Message) -> list[tuple[str, str]]:
    """(name, arguments as text) of each tool call of an assistant message (OpenAI's shape,
    ``{"function": {"name", "arguments"}}``, or the function itself)."""
    calls = message.get("tool_calls")
    out = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            arguments = function.get("arguments", "")
            out.append((function["name"], arguments if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False)))
    return out


# ------------------------------------------------------------------------------ token masks

def mask_from_encoding(enc: Any, spans: list[tuple[int, int]]) -> list[int] | None:
    """`mask_from_offsets` from a few lookups per span (`char_to_token` at its ends) instead of
    the offsets of every token; None where a span end falls on a character no token covers."""
    n = len(enc)                  # not len(enc.ids): that copies every id into a list
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


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
                      ) -> list[int]:
    """1 for each token whose first character lies in one of `spans` (sorted, disjoint)."""
    if not spans:
        return [0] * len(offsets)
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    span_SE = np.asarray(spans, dtype=np.int64)
    k = np.searchsorted(span_SE[:, 1], starts, side="right")      # first span ending after it
    inside = k < len(span_SE)
    k = np.minimum(k, len(span_SE) - 1)
    return ((span_SE[k, 0] <= starts) & inside).astype(np.int8).tolist()
