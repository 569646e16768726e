import pytest

from posttrain.data.formats import (ChatRecord, FormatConfig, PreferenceRecord, PromptRecord,
                                    SequenceRecord, UnpairedRecord, parse_row)
from posttrain.errors import DataError

CHAT = FormatConfig("chat")


def _err(row, cfg=CHAT) -> DataError:
    with pytest.raises(DataError) as e:
        parse_row(row, cfg, file="data.jsonl", line=7)
    assert "data.jsonl:7" in str(e.value)
    return e.value


def test_chat_ok():
    rec = parse_row({"messages": [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "u"},
                                  {"role": "assistant", "content": "a"}]}, CHAT)
    assert isinstance(rec, ChatRecord) and len(rec.messages) == 3


@pytest.mark.parametrize("row, field, reason", [
    ({}, "messages", "missing_field"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "wrong_type"),
    ({"messages": [{"role": "user", "content": "u"}]}, "messages", "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "robot", "content": "a"}]},
     "messages[1].role", "bad_role"),
    ({"messages": [{"content": "u"}]}, "messages[0].role", "missing_field"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", "wrong_type"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", "empty"),
    ({"messages": [{"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a", "train": False}]},
     "messages", "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a", "train": "yes"}]},
     "messages[1].train", "wrong_type"),
    (["not", "a", "dict"], "<row>", "not_an_object"),
])
def test_chat_errors_name_field_and_reason(row, field, reason):
    err = _err(row)
    assert err.field == field and err.reason == reason
    assert f"field '{field}'" in str(err)


def test_preference_normalizes_strings():
    rec = parse_row({"prompt": "2+2?", "chosen": "4", "rejected": "5"},
                    FormatConfig("preference"))
    assert isinstance(rec, PreferenceRecord)
    assert rec.prompt == [{"role": "user", "content": "2+2?"}]
    assert rec.chosen == [{"role": "assistant", "content": "4"}]


def test_preference_response_must_be_assistant():
    err = _err({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "y"},
               FormatConfig("preference"))
    assert err.field == "chosen[0].role"


def test_unpaired_normalizes_strings_and_keeps_the_label():
    cfg = FormatConfig("unpaired", completion_field="answer", label_field="good")
    rec = parse_row({"prompt": "2+2?", "answer": "4", "good": False}, cfg)
    assert rec == UnpairedRecord([{"role": "user", "content": "2+2?"}],
                                 [{"role": "assistant", "content": "4"}], False)


@pytest.mark.parametrize("row, field, reason, says", [
    ({"prompt": "q", "completion": "a"}, "label", "missing_field", "row has: completion, prompt"),
    ({"prompt": "q", "completion": "a", "label": 1}, "label", "wrong_type", "got 1 (int)"),
    ({"prompt": "q", "completion": "a", "label": None}, "label", "wrong_type", "got None"),
    ({"prompt": "q", "completion": [{"role": "user", "content": "a"}], "label": True},
     "completion[0].role", "bad_role", "only hold assistant turns"),
    ({"prompt": "q", "label": True}, "completion", "missing_field", "missing required"),
])
def test_unpaired_errors_name_field_and_reason(row, field, reason, says):
    err = _err(row, FormatConfig("unpaired"))
    assert (err.field, err.reason) == (field, reason) and says in str(err)


def test_prompt_keeps_extra_columns():
    rec = parse_row({"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "id": 3},
                    FormatConfig("prompt"))
    assert isinstance(rec, PromptRecord) and rec.extras == {"answer": "2", "id": 3}


def test_preference_refuses_identical_responses_unless_allowed():
    row = {"prompt": "2+2?", "chosen": "4", "rejected": [{"role": "assistant", "content": "4"}]}
    err = _err(row, FormatConfig("preference"))
    assert (err.field, err.reason) == ("rejected", "identical_pair")
    assert "equals 'chosen'" in str(err) and "allow_identical_pairs" in str(err)
    rec = parse_row(row, FormatConfig("preference", allow_identical_pairs=True))
    assert rec.chosen == rec.rejected


@pytest.mark.parametrize("row, field, says", [
    ({"prompt": "q"}, "answer", "column 'answer' is missing"),
    ({"prompt": "q", "answer": None, "id": 1}, "answer", "column 'answer' is null"),
    ({"prompt": "q", "answer": "5"}, "rubric", "the row has: answer, prompt"),
])
def test_prompt_refuses_a_row_without_a_required_column(row, field, says):
    err = _err(row, FormatConfig("prompt", required_columns=("answer", "rubric")))
    assert (err.field, err.reason) == (field, "missing_field")
    assert says in str(err) and "data.required_columns" in str(err)


def test_prompt_with_its_required_columns_is_accepted():
    rec = parse_row({"prompt": "q", "answer": "5", "rubric": ""},
                    FormatConfig("prompt", required_columns=("answer", "rubric")))
    assert rec.extras == {"answer": "5", "rubric": ""}


@pytest.mark.parametrize("extras, field", [
    ({"answer": float("nan")}, "answer"),
    ({"answer": "5", "weight": float("inf")}, "weight"),
    ({"answer": "5", "meta": {"scores": [1.0, 2, -float("inf")]}}, "meta.scores[2]"),
    ({"answer": [[0.5], [float("nan")]]}, "answer[1][0]"),
])
def test_prompt_refuses_non_finite_numbers_naming_where(extras, field):
    err = _err({"prompt": "q", **extras}, FormatConfig("prompt"))
    assert (err.field, err.reason) == (field, "non_finite")
    assert f"field '{field}'" in str(err) and "NaN or infinite" in str(err)


def test_prompt_must_not_end_with_assistant():
    err = _err({"prompt": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]}, FormatConfig("prompt"))
    assert err.reason == "bad_role"


def test_sequence_tokens_and_text():
    cfg = FormatConfig("sequence")
    assert parse_row({"tokens": [1, 2, 3]}, cfg) == SequenceRecord(tokens=[1, 2, 3])
    assert parse_row({"text": "abc"}, cfg) == SequenceRecord(text="abc")
    assert _err({"tokens": [1, -2]}, cfg).field == "tokens"
    assert _err({"tokens": []}, cfg).reason == "empty"
    assert _err({"other": 1}, cfg).reason == "missing_field"


def test_custom_column_and_roles():
    cfg = FormatConfig("chat", messages_field="conversation", roles=("human", "gpt", "assistant"))
    rec = parse_row({"conversation": [{"role": "human", "content": "h"},
                                      {"role": "assistant", "content": "a"}]}, cfg)
    assert rec.messages[0]["role"] == "human"
