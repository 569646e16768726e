"""Tool calls parsed from the model's text, the bundled calculator and sandboxed python tools,
and the ``tools`` environment: a bad call is an error observation, never an exception."""

from __future__ import annotations

import pytest

from posttrain.rl.environment import Turn
from posttrain.rl.prompts import PromptRow
from posttrain.rl.tools import (ToolEnvironment, calculator, parse_gemma4_tool_calls,
                                parse_tool_calls)

from ..data.test_tokenizer import hf_tokenizer


def call(name: str, **arguments) -> str:
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text, (), "stop", index)


def test_parses_the_templates_tool_call_format():
    text = ("<think>\nadd them\n</think>\n\n" + call("calculator", expression="2 + 3")
            + "\n" + call("python", code="print(1)"))
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, None), ("python", {"code": "print(1)"}, None)]
    # arguments written as a JSON string, as some models do
    (c,) = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": '
                            '"{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    assert c.arguments == {"expression": "1+1"} and c.error is None
    assert parse_tool_calls("The answer is 5.") == []


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{'name': 'calculator'}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>["calculator"]</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
])
def test_malformed_calls_carry_the_reason(text, error):
    (c,) = parse_tool_calls(text)
    assert error in c.error


@pytest.mark.parametrize("expression, value", [
    ("47 * 38", "1786"), ("13 - 37", "-24"), ("(2 + 3) ** 2", "25"), ("7 / 2", "3.5"),
    ("1 / 3", "1/3"), ("-7 // 2", "-4"), ("17 % 5", "2"), ("2^10", "1024"), ("0.1 + 0.2", "0.3"),
])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("2 ** 1000", "exponents"), ("10 ** 64 * 10 ** 64", "large"),
    ("__import__('os')", "unsupported"), ("x + 1", "unsupported"), ("1 +", "cannot parse"),
    ("1" * 501, "longer than 500"),
])
def test_calculator_refuses_what_it_cannot_evaluate_safely(expression, error):
    with pytest.raises(ValueError, match=error):
        calculator(expression)


def test_tool_environment_answers_calls_and_ends_on_an_answer():
    env = ToolEnvironment(tools=["calculator"])
    row = PromptRow([1, 2], [{"role": "user", "content": "What is 47 * 38?"}], {})
    assert env.reset(row, seed=0) == row.messages
    assert env.tools[0]["function"]["name"] == "calculator"
    out = env.step(turn(call("calculator", expression="47 * 38") + call("python", code="1")
                        + call("calculator", expression="1 / 0") + "<tool_call>{oops}</tool_call>"
                        + call("calculator", expr="1")))
    assert not out.done and out.reward == 0.0
    assert [m["role"] for m in out.messages] == ["tool"] * 5
    contents = [m["content"] for m in out.messages]
    assert contents[0] == "47 * 38 = 1786"
    assert contents[1].startswith("error: unknown tool 'python'")
    assert contents[2] == "error: division by zero"
    assert contents[3].startswith("error: the tool call is not valid JSON")
    assert contents[4] == 'error: the arguments must be {"expression": "..."}'
    assert out.metrics == {"tool_calls": 5.0, "tool_errors": 4.0}
    final = env.step(turn("The answer is 1786.", 1))
    assert final.done and final.messages == []


def test_gemma4_calls_read_back_what_its_template_writes():
    """Gemma 4's template writes a call's arguments in its own notation (`format_argument`):
    strings between <|"|> marks, numbers, booleans, nested mappings and lists, keys sorted.
    Parsing what it renders gives the arguments back; a call cut off or malformed is an
    error observation, as for the JSON format."""
    arguments = {"expression": "47 * 38, {x}: [y]", "n": 3, "f": 2.5, "ok": True, "no": False,
                 "nested": {"a": "b", "list": [1, "two", {"c": False}]}, "empty": {}, "e": []}
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": arguments}},
             {"type": "function", "function": {"name": "clock", "arguments": {}}}]
    raw = hf_tokenizer("gemma4").apply_chat_template(
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False)
    assert [(c.name, c.arguments, c.error) for c in parse_gemma4_tool_calls(raw)] == [
        ("calculator", arguments, None), ("clock", {}, None)]
    for text, error in [('<|tool_call>call:calculator{expression:<|"|>1 + 2', "not closed"),
                        ('<|tool_call>call:calculator{expression<tool_call|>',
                         "a key without a value"),
                        ('<|tool_call>call:calculator{expression:<|"|>1<tool_call|>',
                         "a string is not closed"),
                        ('<|tool_call>call:calculator{a:[1,2}<tool_call|>', "not closed by ']'"),
                        ('<|tool_call>call:{a:1}<tool_call|>', "has no name")]:
        (c,) = parse_gemma4_tool_calls(text)
        assert c.error is not None and error in c.error, (text, c)


def test_tool_environment_reads_gemma4_calls_and_returns_them_as_structure():
    """A Gemma 4 turn's calls are read from its special tokens (`Turn.raw`); each result names
    its call (`tool_call_id`), and the calls come back as structure for the template."""
    env = ToolEnvironment(tools=["calculator"])
    raw = ('<|tool_call>call:calculator{expression:<|"|>47 * 38<|"|>}<tool_call|>'
           '<|tool_call>call:calculator{expression:<|"|>1 / 0<|"|>}<tool_call|>')
    out = env.step(Turn("call:calculator{expression:47 * 38}", (), "stop", 0, raw))
    assert out.messages == [
        {"role": "tool", "tool_call_id": "call_0", "content": "47 * 38 = 1786"},
        {"role": "tool", "tool_call_id": "call_1", "content": "error: division by zero"}]
    assert out.tool_calls == [
        {"id": f"call_{k}", "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": e}}}
        for k, e in enumerate(["47 * 38", "1 / 0"])]
    assert out.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}


def test_unknown_bundled_tool_is_refused():
    with pytest.raises(ValueError, match="bundled tools are"):
        ToolEnvironment(tools=["shell"])


def test_python_tool_runs_in_the_sandbox_with_its_limits():
    env = ToolEnvironment(tools=["python"], timeout_s=2.0, cpu_s=2, memory_mb=128,
                          max_result_chars=20)
    ok, slow, big, network, long = env.step(turn(
        call("python", code="print(6 * 7)")
        + call("python", code="while True: pass")
        + call("python", code="x = bytearray(512 * 2**20)")
        + call("python", code="import socket; socket.create_connection(('1.1.1.1', 53))")
        + call("python", code="print('a' * 100)"))).messages
    assert ok["content"] == "42"
    assert slow["content"].startswith("error: timeout")
    assert big["content"].startswith("error: memory")
    assert network["content"] == "error: network: sand [truncated]"
    assert long["content"] == "a" * 20 + " [truncated]"
