"""Dataset shapes: the row layouts datasets are downloaded in, detected per source and turned
into the rows `posttrain.data.formats` parses.

A *format* says what a recipe trains on (``chat`` for SFT, ``prompt`` for RL, ``preference``
for DPO, ...); a *shape* says how a row of it is laid out. Each format reads these shapes
(column names as `FormatConfig` and ``data.columns`` name them; defaults shown):

========== =================== ============================================================
format     shape               a row
========== =================== ============================================================
chat       messages            ``{"messages": [{"role": ..., "content": ...}, ...]}``
chat       sharegpt            ``{"conversations": [{"from": "human", "value": ...}, ...],
                               "system"?}``: roles mapped (`DEFAULT_ROLE_MAP`,
                               ``data.role_map``); a top-level ``system`` string opens the
                               conversation; turns written ``role``/``content`` work too
chat       alpaca              ``{"instruction", "input"?, "output", "system"?, "history"?}``
                               -> system, the ``history`` pairs ``[[user, assistant], ...]``,
                               user ``instruction + "\\n" + input`` (just ``instruction`` when
                               ``input`` is empty; LLaMA-Factory's join), assistant ``output``
chat       prompt_completion   ``{"prompt": str | messages, "completion": str | messages}``
                               (TRL's prompt-completion type): a string prompt is one user
                               turn, a string completion one assistant turn, rendered with the
                               chat template; the loss is on the completion only
chat       text                ``{"text": ...}`` (TRL's language-modelling type): a document,
                               no chat template, every token trained (`formats`)
prompt     prompt              ``{"prompt": str | messages, <extra columns>}``
prompt     sharegpt            ``{"conversations": [...], <extra columns>}``: the prompt turns
prompt     alpaca              ``{"instruction", "input"?, "system"?, "history"?, <extra
                               columns>}``: the user turn as for chat (``output``, if present,
                               stays an extra column, e.g. a reference answer)
preference preference          ``{"prompt", "chosen", "rejected"}``
preference implicit_preference ``{"chosen": messages, "rejected": messages}`` (TRL's implicit
                               prompt): the leading messages both share are the prompt
unpaired   unpaired            ``{"prompt", "completion", "label"}``
sequence   sequence            ``{"tokens": [...]}`` or ``{"text": ...}``
========== =================== ============================================================

**Content parts.** In every message list (and ShareGPT ``value``), content may be a list of
OpenAI content parts, ``[{"type": "text", "text": ...}, ...]``: the text parts are joined with
no separator, as the templates that render such lists themselves join them, so the joined
string renders as the list does: Qwen3.5 concatenates the parts' texts as they are, Gemma 3 and
Gemma 4 trim each part first. Which of the two a template does is probed once per tokenizer
(`template_strips_parts`; `FormatConfig.strip_text_parts`); templates that do not render lists
(Qwen3, Llama 3.1) get the plain concatenation. (Gemma 3 renders only the first part of a
system message's list; the joined string keeps them all.) A part of another type
(``image_url``, ``input_audio``, ...) is refused, naming the part and its type: posttrain trains
on text.

**Detection** follows TRL's dataset-type detection: by the keys a row has. `detect` returns the
first shape of the format, in the order of the table, whose keys the row has (a row with both
``messages`` and ``text`` is ``messages``; Alpaca rows that also carry a rendered ``text`` are
``alpaca``). `SourceShape` decides a source's shape from its first row and then checks every
row against it: a row of another shape is a ``mixed_shapes`` error naming both shapes and where
the source's shape was decided; a row that fits no shape once the shape is decided is parsed as
the source's shape, so its error names the missing field. A first row that fits no shape is an
`UnknownShape` error naming the shapes checked and the row's keys: the source cannot be read,
so it stops `prepare` even with ``on_bad_row: skip``. ``shape:`` on a source entry forces a
shape and skips detection.

Everything here is pure Python (no torch, no tokenizer): conversions only move and join what
is there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.errors import DataError

if TYPE_CHECKING:
    from posttrain.data.formats import FormatConfig

# The shapes each format reads, in detection order; the first is the format's own shape.
SHAPES: dict[str, tuple[str, ...]] = {
    "chat": ("messages", "sharegpt", "prompt_completion", "alpaca", "text"),
    "prompt": ("prompt", "sharegpt", "alpaca"),
    "preference": ("preference", "implicit_preference"),
    "unpaired": ("unpaired",),
    "sequence": ("sequence",),
}
ALL_SHAPES = tuple(dict.fromkeys(s for shapes in SHAPES.values() for s in shapes))

SHAREGPT_FIELD = "conversations"
# ShareGPT speaker names -> roles: the common ones (ShareGPT dumps, LLaMA-Factory's defaults);
# a function_call turn is the assistant's call, written as text; an observation is its result.
DEFAULT_ROLE_MAP: dict[str, str] = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "chatgpt": "assistant", "assistant": "assistant", "function_call": "assistant",
    "observation": "tool", "tool": "tool",
}
ALPACA_INPUT_JOIN = "\n"     # instruction + "\n" + input, as LLaMA-Factory's Alpaca converter


class UnknownShape(DataError):
    """A source's first row fits none of its format's shapes: the source cannot be read."""

    def __init__(self, message: str, *, file: str | None, line: int | None):
        super().__init__(message, file=file, line=line, field="<row>", reason="unknown_shape")


def check_shape(fmt: str, shape: str | None, key: str = "shape") -> None:
    """A `ValueError` naming `key` unless `shape` is None or a shape of format `fmt` (config
    classes check it in ``__post_init__``, where the loader adds the file)."""
    if shape is not None and shape not in SHAPES[fmt]:
        raise ValueError(f"{key}: {shape!r} is not a shape of format {fmt} (its shapes: "
                          f"{', '.join(SHAPES[fmt])})")


def detect(row: dict[str, Any], cfg: FormatConfig) -> str | None:
    """The first shape of `cfg.format` whose keys `row` has, or None (module docstring)."""
    for shape in SHAPES[cfg.format]:
        if _FITS[shape](row, cfg):
            return shape
    return None


def describe(shape: str, cfg: FormatConfig) -> str:
    """What a row of `shape` holds, in `cfg`'s column names, for error messages."""
    return _DESCRIBE[shape](cfg)


class SourceShape:
    """The shape of one source's rows: `forced`, or decided by its first row (module docstring).

    `of(row, file, line)` returns the shape to parse `row` as, or raises `UnknownShape` (first
    row fits no shape) or a ``mixed_shapes`` `DataError`; `shape` is the decided shape (None
    before the first row).
    """

    def __init__(self, cfg: FormatConfig, forced: str | None = None):
        check_shape(cfg.format, forced)
        self.cfg = cfg
        self.shape = forced
        self._forced = forced is not None
        self._decided_at = "the source's `shape:`"

    def of(self, row: Any, file: str | None, line: int | None) -> str:
        if self._forced:
            return self.shape
        found = detect(row, self.cfg) if isinstance(row, dict) else None
        if self.shape is None:
            if found is None:
                if not isinstance(row, dict):   # the parser names it (not_an_object)
                    return SHAPES[self.cfg.format][0]
                raise self._unknown(row, file, line)
            self.shape = found
            self._decided_at = f"{file}:{line}" if line is not None else str(file)
            return found
        if found is not None and found != self.shape:
            raise DataError(f"this row is {found} ({describe(found, self.cfg)}) but the source's "
                            f"rows are {self.shape} ({describe(self.shape, self.cfg)}), as "
                            f"decided by its first row, {self._decided_at}; a source holds rows "
                            "of one shape: give each shape's files a source of their own",
                            file=file, line=line, field="<row>", reason="mixed_shapes")
        return self.shape

    def _unknown(self, row: dict, file: str | None, line: int | None) -> UnknownShape:
        shapes = SHAPES[self.cfg.format]
        checked = "; ".join(f"{s}: {describe(s, self.cfg)}" for s in shapes)
        keys = ", ".join(sorted(map(str, row))) or "none"
        return UnknownShape(
            f"the source's first row fits none of the shapes of format {self.cfg.format} "
            f"({checked}); the row has keys: {keys}. Name the columns (data.columns) or set "
            f"`shape:` ({' | '.join(shapes)}) on the source entry to read it as one of them",
            file=file, line=line)


def to_canonical(row: dict[str, Any], shape: str, cfg: FormatConfig, *,
                 file: str | None = None, line: int | None = None) -> dict[str, Any]:
    """`row` (of `shape`) as a row `formats.parse_row` reads for `cfg.format`: ShareGPT and
    Alpaca rows become messages (chat) or prompt rows, an implicit-prompt pair gets its
    prompt, and content parts are joined in every message list. Fields that are not there or
    of the wrong type are left for the parser to name, except those only this shape has."""
    def error(field: str, message: str, reason: str) -> DataError:
        return DataError(message, file=file, line=line, field=field, reason=reason)

    return _CONVERT[shape](row, cfg, error)


# --------------------------------------------------------------------------- content parts


def template_strips_parts(hf_tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template trims each text part of a content list before
    joining them (Gemma 3, Gemma 4) rather than joining them as they are (Qwen3.5); False for a
    template that does not render lists, or fails on the probe."""
    probe = [{"role": "user", "content": [{"type": "text", "text": "Probe "},
                                          {"type": "text", "text": " part"}]}]
    try:
        text = hf_tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:   # a template's own refusal, of any kind: it does not render lists
        return False
    return "Probepart" in text and "Probe  part" not in text


def join_content(content: Any, path: str, error: Callable[..., DataError],
                 strip: bool = False) -> Any:
    """A list of OpenAI content parts -> their texts joined, each stripped first if `strip`
    (module docstring); anything else is returned as it is, for the parser to check."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise error(where, f"a content part must be an object, got {type(part).__name__}",
                        "wrong_type")
        kind = part.get("type")
        if kind != "text":
            raise error(f"{where}.type", f"a content part of type {kind!r}: only text parts "
                        "({'type': 'text', 'text': ...}) can be trained on; remove the part or "
                        "the row", "non_text_content")
        text = part.get("text")
        if not isinstance(text, str):
            got = "missing" if "text" not in part else type(text).__name__
            raise error(f"{where}.text", f"a text part's text must be a string, got {got}",
                        "wrong_type")
        texts.append(text.strip() if strip else text)
    return "".join(texts)


def _join_messages(value: Any, name: str, cfg: FormatConfig,
                   error: Callable[..., DataError]) -> Any:
    """A message list with every message's content parts joined; anything else unchanged."""
    if not isinstance(value, list):
        return value
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": join_content(m["content"], f"{name}[{i}].content", error,
                                              cfg.strip_text_parts)}
        out.append(m)
    return out


def _joined(row: dict, fields: tuple[str, ...], cfg: FormatConfig, error) -> dict:
    out = dict(row)
    for name in fields:
        if name in out:
            out[name] = _join_messages(out[name], name, cfg, error)
    return out


# --------------------------------------------------------------------------- ShareGPT


def _is_from_value(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and isinstance(value[0], dict)
            and "from" in value[0] and "value" in value[0])


def _sharegpt_field(row: dict, cfg: FormatConfig) -> str:
    return SHAREGPT_FIELD if isinstance(row.get(SHAREGPT_FIELD), list) else cfg.messages_field


def _sharegpt_messages(row: dict, cfg: FormatConfig, error) -> tuple[list[dict], str]:
    """The turns of a ShareGPT row as messages (a top-level ``system`` first), and the field
    they came from."""
    name = _sharegpt_field(row, cfg)
    turns = row.get(name)
    if not isinstance(turns, list):
        got = "missing" if name not in row else type(turns).__name__
        raise error(name, f"expected a list of turns, got {got}", "wrong_type")
    if not turns:
        raise error(name, "empty conversation", "empty")
    role_map = dict(cfg.role_map)
    messages = _system_message(row, error)
    for i, turn in enumerate(turns):
        path = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise error(path, f"a turn must be an object, got {type(turn).__name__}",
                        "wrong_type")
        speaker_key, text_key = ("from", "value") if "from" in turn else ("role", "content")
        speaker = turn.get(speaker_key)
        if speaker is None:
            raise error(f"{path}.from", "missing speaker ('from')", "missing_field")
        role = role_map.get(speaker)
        if role is None:
            raise error(f"{path}.{speaker_key}", f"unknown speaker {speaker!r} (known: "
                        f"{', '.join(sorted(role_map))}); map it to a role with data.role_map, "
                        f"e.g. role_map: {{{speaker}: assistant}}", "bad_role")
        text = join_content(turn.get(text_key), f"{path}.{text_key}", error,
                            cfg.strip_text_parts)
        if not isinstance(text, str):
            got = "missing" if text_key not in turn else type(text).__name__
            raise error(f"{path}.{text_key}", f"must be a string, got {got}", "wrong_type")
        if not text.strip() and role != "assistant":
            raise error(f"{path}.{text_key}", "empty turn", "empty")
        message = {"role": role, "content": text}
        if "train" in turn:
            message["train"] = turn["train"]
        messages.append(message)
    return messages, name


def _system_message(row: dict, error) -> list[dict]:
    system = row.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise error("system", f"must be a string, got {type(system).__name__}", "wrong_type")
    return [{"role": "system", "content": system}] if system.strip() else []


# --------------------------------------------------------------------------- Alpaca

_ALPACA_KEYS = ("instruction", "input", "system", "history")


def _alpaca_prompt(row: dict, error) -> list[dict]:
    """system, the history pairs, and the user turn of an Alpaca row (module docstring)."""
    instruction = row.get("instruction")
    if not isinstance(instruction, str):
        raise error("instruction", f"must be a string, got {type(instruction).__name__}",
                    "wrong_type")
    given = row.get("input")
    if given is not None and not isinstance(given, str):
        raise error("input", f"must be a string, got {type(given).__name__}", "wrong_type")
    user = ALPACA_INPUT_JOIN.join(t for t in (instruction, given) if t and t.strip())
    if not user.strip():
        raise error("instruction", "empty instruction", "empty")
    messages = _system_message(row, error)
    history = row.get("history")
    if history is not None and not isinstance(history, list):
        raise error("history", f"must be a list of [user, assistant] pairs, got "
                    f"{type(history).__name__}", "wrong_type")
    for i, pair in enumerate(history or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(t, str) and t.strip() for t in pair)):
            raise error(f"history[{i}]", "a history entry must be a [user, assistant] pair of "
                        "non-empty strings", "wrong_type")
        messages += [{"role": "user", "content": pair[0]},
                     {"role": "assistant", "content": pair[1]}]
    return [*messages, {"role": "user", "content": user}]


# --------------------------------------------------------------------------- conversions


def _messages_row(row, cfg, error):
    return {cfg.messages_field: _join_messages(row.get(cfg.messages_field), cfg.messages_field,
                                               cfg, error)} if cfg.messages_field in row else row


def _sharegpt_chat(row, cfg, error):
    messages, _ = _sharegpt_messages(row, cfg, error)
    return {cfg.messages_field: messages}


def _alpaca_chat(row, cfg, error):
    output = row.get("output")
    if not isinstance(output, str):
        got = "missing" if "output" not in row else type(output).__name__
        raise error("output", f"must be a string, got {got}", "wrong_type" if
                    "output" in row else "missing_field")
    return {cfg.messages_field: [*_alpaca_prompt(row, error),
                                 {"role": "assistant", "content": output}]}


def _sharegpt_prompt(row, cfg, error):
    messages, name = _sharegpt_messages(row, cfg, error)
    if messages[-1]["role"] == "assistant":
        i = len(row[name]) - 1
        raise error(f"{name}[{i}]", "a prompt must not end with the assistant's turn: keep the "
                    "prompt turns only (a reference answer goes in a column of its own, for the "
                    "rewards)", "bad_role")
    extras = {k: v for k, v in row.items() if k not in (name, "system")}
    return {**extras, cfg.prompt_field: messages}


def _alpaca_prompt_row(row, cfg, error):
    extras = {k: v for k, v in row.items() if k not in _ALPACA_KEYS}
    return {**extras, cfg.prompt_field: _alpaca_prompt(row, error)}


def _implicit_preference(row, cfg, error):
    """TRL's implicit prompt: the leading messages `chosen` and `rejected` share."""
    row = _joined(row, (cfg.chosen_field, cfg.rejected_field), cfg, error)
    chosen, rejected = row.get(cfg.chosen_field), row.get(cfg.rejected_field)
    for name, value in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
        if not isinstance(value, list):
            raise error(name, f"without a '{cfg.prompt_field}' column, chosen and rejected must "
                        f"be conversations (lists of messages) that share their prompt; got "
                        f"{type(value).__name__}", "wrong_type")
    shared = 0
    while (shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]):
        shared += 1
    if shared == 0:
        raise error(cfg.prompt_field, f"no '{cfg.prompt_field}' column, and '{cfg.chosen_field}' "
                    f"and '{cfg.rejected_field}' share no leading message to be the prompt",
                    "missing_field")
    rest = {k: v for k, v in row.items() if k not in (cfg.chosen_field, cfg.rejected_field)}
    return {**rest, cfg.prompt_field: chosen[:shared], cfg.chosen_field: chosen[shared:],
            cfg.rejected_field: rejected[shared:]}


_CONVERT: dict[str, Callable[[dict, Any, Callable[..., DataError]], dict]] = {
    "messages": _messages_row,
    "sharegpt": lambda row, cfg, error: (_sharegpt_chat if cfg.format == "chat"
                                         else _sharegpt_prompt)(row, cfg, error),
    "alpaca": lambda row, cfg, error: (_alpaca_chat if cfg.format == "chat"
                                       else _alpaca_prompt_row)(row, cfg, error),
    "prompt_completion": lambda row, cfg, error: _joined(
        row, (cfg.prompt_field, cfg.completion_field), cfg, error),
    "text": lambda row, cfg, error: row,
    "prompt": lambda row, cfg, error: _joined(row, (cfg.prompt_field,), cfg, error),
    "preference": lambda row, cfg, error: _joined(
        row, (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field), cfg, error),
    "implicit_preference": _implicit_preference,
    "unpaired": lambda row, cfg, error: _joined(
        row, (cfg.prompt_field, cfg.completion_field), cfg, error),
    "sequence": lambda row, cfg, error: row,
}

_FITS: dict[str, Callable[[dict, Any], bool]] = {
    "messages": lambda r, c: c.messages_field in r and not _is_from_value(r[c.messages_field]),
    "sharegpt": lambda r, c: (isinstance(r.get(SHAREGPT_FIELD), list)
                              or _is_from_value(r.get(c.messages_field))),
    "alpaca": lambda r, c: "instruction" in r and (c.format != "chat" or "output" in r),
    "prompt_completion": lambda r, c: c.prompt_field in r and c.completion_field in r,
    "text": lambda r, c: c.text_field in r,
    "prompt": lambda r, c: c.prompt_field in r,
    "preference": lambda r, c: all(k in r for k in (c.prompt_field, c.chosen_field,
                                                    c.rejected_field)),
    "implicit_preference": lambda r, c: (c.chosen_field in r and c.rejected_field in r
                                         and c.prompt_field not in r),
    "unpaired": lambda r, c: True,
    "sequence": lambda r, c: True,
}

_DESCRIBE: dict[str, Callable[[Any], str]] = {
    "messages": lambda c: f"'{c.messages_field}', a list of role/content messages",
    "sharegpt": lambda c: f"'{SHAREGPT_FIELD}', a list of from/value turns",
    "alpaca": lambda c: ("'instruction' and 'output'" if c.format == "chat"
                         else "'instruction'") + ", Alpaca",
    "prompt_completion": lambda c: f"'{c.prompt_field}' and '{c.completion_field}'",
    "text": lambda c: f"'{c.text_field}', a document",
    "prompt": lambda c: f"'{c.prompt_field}'",
    "preference": lambda c: f"'{c.prompt_field}', '{c.chosen_field}' and '{c.rejected_field}'",
    "implicit_preference": lambda c: (f"'{c.chosen_field}' and '{c.rejected_field}' "
                                      f"conversations without '{c.prompt_field}'"),
    "unpaired": lambda c: f"'{c.prompt_field}', '{c.completion_field}' and '{c.label_field}'",
    "sequence": lambda c: "'tokens' or 'text'",
}
