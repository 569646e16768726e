"""Tool use for RL: tool calls parsed from the model's text, the bundled tools, their environment.

**Format.** A tool call is what Qwen3's (and Hermes/ChatML) templates render for an assistant's
``tool_calls``, and what those models are trained to write::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "47 * 38"}}
    </tool_call>

or Gemma 4's, read from the turn with its special tokens (`Turn.raw`), which ends the turn with
``<|tool_response>``: ``<|tool_call>call:calculator{expression:<|"|>47 * 38<|"|>}<tool_call|>``
(`parse_gemma4_tool_calls`). For Gemma 4 the environment also returns the calls as structure
(`StepResult.tool_calls`), since its template renders the results from them.

A turn may hold several calls; each result comes back as one ``{"role": "tool", "content": ...}``
message, in order. A call that cannot be parsed (bad JSON, no name, an unknown tool, bad
arguments, an unclosed tag) gets an error message as its result (``error: ...``), never an
exception: the model learns from it like from any other observation.

**Tools.** ``calculator`` evaluates an arithmetic expression exactly (integers and fractions;
``+ - * / // % **`` and parentheses; no names, no calls; exponents up to 64 and results up to
10^100, so no expression can exhaust memory or time) and answers like a calculator's display,
``47 * 38 = 1786``: the result after a space, as it stands in "The answer is 1786.", which a
tokenizer that merges digits into numbers encodes as the same token. ``python`` runs code in
the sandbox of `posttrain.rl.sandbox` (wall-clock and CPU time, address space and output
limits, no network, no subprocesses) and returns its stdout, or the kind of failure and the
tail of stderr.

**Environment** (``environment: {kind: tools}``): a turn with tool calls gets their results and
the model goes on; a turn without one is the final answer and ends the episode (scored by the
reward functions). Params: ``tools`` (names, default ``[calculator]``), ``max_result_chars``,
and the python tool's ``timeout_s``, ``cpu_s``, ``memory_mb`` and ``isolation`` (``required``:
a config with the python tool fails at launch where no isolated sandbox works; ``weak``:
then run it with rlimits and the audit hook only).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable

from posttrain.rl.environment import Message, StepResult, Turn
from posttrain.rl.sandbox import IsolationMode, SandboxLimits, require_isolation, run_python

if TYPE_CHECKING:                       # prompts reads shards (pyarrow, torch): not needed here
    from posttrain.rl.prompts import PromptRow

__all__ = ["TOOL_SCHEMAS", "ToolCall", "ToolEnvironment", "calculator", "parse_gemma4_tool_calls",
           "parse_tool_calls"]

_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "calculator": {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and "
                       "parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python",
        "description": "Run Python code in a sandbox (no network) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},
}


@dataclass(frozen=True)
class ToolCall:
    """A parsed call, or the reason it could not be parsed (`error`)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in `text`, in order (module docstring)."""
    calls = []
    for match in _CALL_RE.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, {}, "the tool call is not closed by </tool_call>"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):          # some models write the arguments as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], {}, "the arguments must be a JSON object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


# Gemma 4 writes a call in its own notation between special tokens, which `Turn.raw` keeps:
# <|tool_call>call:NAME{key:VALUE,...}<tool_call|>, strings between <|"|> marks, numbers, true,
# false, and nested {...} and [...] (its template's `format_argument`, read backwards).
_GEMMA4_CALL_RE = re.compile(r"<\|tool_call>call:([^{<]*)\{(.*?)(<tool_call\|>|$)", re.DOTALL)
_GEMMA4_QUOTE = '<|"|>'


def parse_gemma4_tool_calls(raw: str) -> list[ToolCall]:
    """Every Gemma 4 call in `raw` (a turn with its special tokens), in order; an unclosed or
    malformed one as an error (module docstring)."""
    calls = []
    for match in _GEMMA4_CALL_RE.finditer(raw):
        name, body, closed = match.group(1).strip(), match.group(2), bool(match.group(3))
        if not closed:
            calls.append(ToolCall(None, {}, "the tool call is not closed by <tool_call|>"))
            continue
        try:
            arguments, end = _gemma4_object(body, 0)
            if body[end:].strip():
                raise ValueError(f"unexpected {body[end:end + 20]!r} after the arguments")
        except ValueError as e:
            calls.append(ToolCall(name or None, {}, f"the tool call's arguments: {e}"))
            continue
        calls.append(ToolCall(name, arguments) if name else
                     ToolCall(None, {}, "the tool call has no name"))
    return calls


def _gemma4_object(text: str, at: int) -> tuple[dict[str, Any], int]:
    """The mapping whose body starts at `at` (after its "{"), and the index after its "}"."""
    out: dict[str, Any] = {}
    while True:
        if text.startswith("}", at):
            return out, at + 1
        if text.startswith(_GEMMA4_QUOTE, at):
            key, at = _gemma4_string(text, at)
        else:
            colon = text.find(":", at)
            if colon < 0:
                raise ValueError("a key without a value")
            key, at = text[at:colon].strip(), colon
        if not text.startswith(":", at):
            raise ValueError(f"expected ':' after {key!r}")
        out[key], at = _gemma4_value(text, at + 1)
        if text.startswith(",", at):
            at += 1
        elif not text.startswith("}", at):
            raise ValueError("the arguments are not closed by '}'")


def _gemma4_value(text: str, at: int) -> tuple[Any, int]:
    if text.startswith(_GEMMA4_QUOTE, at):
        return _gemma4_string(text, at)
    if text.startswith("{", at):
        return _gemma4_object(text, at + 1)
    if text.startswith("[", at):
        items: list[Any] = []
        at += 1
        while not text.startswith("]", at):
            item, at = _gemma4_value(text, at)
            items.append(item)
            if text.startswith(",", at):
                at += 1
            elif not text.startswith("]", at):
                raise ValueError("a list is not closed by ']'")
        return items, at + 1
    end = at
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[at:end].strip()
    if not word:
        raise ValueError("a key without a value")
    constants = {"true": True, "false": False, "null": None, "None": None}
    if word in constants:
        return constants[word], end
    for kind in (int, float):
        try:
            return kind(word), end
        except ValueError:
            pass
    return word, end                # a bare word: the model meant a string


def _gemma4_string(text: str, at: int) -> tuple[str, int]:
    start = at + len(_GEMMA4_QUOTE)
    end = text.find(_GEMMA4_QUOTE, start)
    if end < 0:
        raise ValueError("a string is not closed by <|\"|>")
    return text[start:end], end + len(_GEMMA4_QUOTE)


# --------------------------------------------------------------------------- calculator

_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10 ** 100
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """The exact value of an arithmetic `expression` (an integer, or a fraction in lowest
    terms as a decimal when it has a finite one, else ``p/q``); raises ValueError saying why
    it cannot be evaluated."""
    if len(expression) > 500:
        raise ValueError("the expression is longer than 500 characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(str(node.value))       # the decimal written, not its binary float
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("a number is too large")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponents must be integers of at most {_MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
        value = Fraction(_BINARY[type(node.op)](left, right))
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"unsupported: {ast.unparse(node)!r} (numbers and + - * / // % ** only)")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:                                # a finite decimal
        text = f"{float(value):.12f}".rstrip("0")
        if Fraction(text) == value:
            return text
    return f"{value.numerator}/{value.denominator}"


# --------------------------------------------------------------------------- environment


class ToolEnvironment:
    """The bundled ``tools`` environment (module docstring)."""

    def __init__(self, tools: list[str] | tuple[str, ...] = ("calculator",),
                 max_result_chars: int = 2000, timeout_s: float = 5.0, cpu_s: int = 5,
                 memory_mb: int = 256, isolation: IsolationMode = "required"):
        unknown = sorted(set(tools) - set(TOOL_SCHEMAS))
        if unknown or not tools:
            raise ValueError(f"params.tools: {unknown or 'none'} given; the bundled tools are "
                             f"{sorted(TOOL_SCHEMAS)}")
        if max_result_chars < 1:
            raise ValueError("params.max_result_chars must be >= 1")
        self.tools = [TOOL_SCHEMAS[t] for t in tools]
        self.max_result_chars = max_result_chars
        self.limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s,
                                    memory_bytes=memory_mb * 2**20, isolation=isolation)
        self._run: dict[str, Callable[[dict[str, Any]], str]] = {
            "calculator": lambda a: _display(_argument(a, "expression")),
            "python": lambda a: self._python(_argument(a, "code"))}
        self._enabled = set(tools)

    @staticmethod
    def check_params(tools: list[str] | tuple[str, ...] = ("calculator",),
                     isolation: IsolationMode = "required", **params: Any) -> None:
        """At config time: the python tool needs an isolated sandbox unless `isolation` is
        "weak" (`posttrain.rl.sandbox.require_isolation`)."""
        del params
        if "python" in tools:
            require_isolation(isolation, "environment.params.isolation")

    def reset(self, row: PromptRow, seed: int) -> list[Message]:
        return row.messages

    def step(self, turn: Turn) -> StepResult:
        gemma4 = "<|tool_call>" in turn.raw
        calls = parse_gemma4_tool_calls(turn.raw) if gemma4 else parse_tool_calls(turn.text)
        if not calls:
            return StepResult(done=True)
        results = [self._call(c) for c in calls]
        errors = sum(r.startswith("error: ") for r in results)
        metrics = {"tool_calls": float(len(calls)), "tool_errors": float(errors)}
        if not gemma4:
            return StepResult([{"role": "tool", "content": r} for r in results],
                              metrics=metrics)
        # Gemma 4 renders each result inside the model's turn, named by its call
        ids = [f"call_{k}" for k in range(len(calls))]
        structured = [{"id": i, "type": "function",
                       "function": {"name": c.name or "unknown", "arguments": c.arguments}}
                      for i, c in zip(ids, calls)]
        return StepResult([{"role": "tool", "tool_call_id": i, "content": r}
                           for i, r in zip(ids, results)], metrics=metrics,
                          tool_calls=structured)

    def _call(self, call: ToolCall) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in self._enabled:
            return (f"error: unknown tool {call.name!r}; the tools are "
                    f"{sorted(self._enabled)}")
        try:
            result = self._run[call.name](call.arguments)
        except ValueError as e:
            return f"error: {e}"
        if len(result) > self.max_result_chars:
            result = result[:self.max_result_chars] + " [truncated]"
        return result

    def _python(self, code: str) -> str:
        result = run_python(code, self.limits)
        if result.ok:
            return result.stdout.rstrip("\n")
        return f"error: {result.error}: {result.detail.strip()[-500:]}"


def _display(expression: str) -> str:
    return f"{expression.strip()} = {calculator(expression)}"


def _argument(arguments: dict[str, Any], name: str) -> str:
    extra = sorted(set(arguments) - {name})
    if name not in arguments or not isinstance(arguments[name], str) or extra:
        raise ValueError(f"the arguments must be {{\"{name}\": \"...\"}}")
    return arguments[name]
