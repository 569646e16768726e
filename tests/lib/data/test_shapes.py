"""Dataset shapes (posttrain.data.shapes): each shape, prepared through `steps.prepare.run`,
gives the token ids and loss masks of its `messages` equivalent (written out by hand here);
`text` rows give the tokenizer's ids plus EOS with every token trained; content parts render as
the real templates render the list; shape detection, forcing, mixing and unknown shapes; a
JSON array file as its JSON Lines twin."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from posttrain.config.recipes import PrepareConfig, load_recipe
from posttrain.data.formats import FormatConfig, PreferenceRecord, PromptRecord, parse_row
from posttrain.data.tokenizer import ChatTokenizer, TokenizerConfig
from posttrain.errors import ConfigError, DataError
from steps import prepare

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "assets" / "tokenizer")


def _msg(role, content, **extra):
    return {"role": role, "content": content, **extra}


def _parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


# name -> (rows of the shape, their messages equivalent; None: a text source, checked apart)
CASES = {
    "sharegpt": (
        [{"system": "Be brief.",
          "conversations": [{"from": "human", "value": "What is 2 + 3?"},
                            {"from": "gpt", "value": "5."},
                            {"from": "human", "value": "And 4 + 4?"},
                            {"from": "gpt", "value": "8."}]},
         {"conversations": [{"from": "system", "value": "You add."},
                            {"from": "human", "value": "1 + 1?"},
                            {"from": "function_call", "value": '{"name": "add"}'},
                            {"from": "observation", "value": "2"},
                            {"from": "gpt", "value": "It is 2."}]}],
        [[_msg("system", "Be brief."), _msg("user", "What is 2 + 3?"), _msg("assistant", "5."),
          _msg("user", "And 4 + 4?"), _msg("assistant", "8.")],
         [_msg("system", "You add."), _msg("user", "1 + 1?"),
          _msg("assistant", '{"name": "add"}'), _msg("tool", "2"),
          _msg("assistant", "It is 2.")]]),
    "alpaca": (
        [{"instruction": "Add the numbers.", "input": "2 3", "output": "5"},
         {"instruction": "Say hi.", "input": "", "output": "Hi!", "system": "Be kind."},
         {"instruction": "And 4 + 4?", "output": "8", "history": [["2 + 3?", "5"]]}],
        [[_msg("user", "Add the numbers.\n2 3"), _msg("assistant", "5")],
         [_msg("system", "Be kind."), _msg("user", "Say hi."), _msg("assistant", "Hi!")],
         [_msg("user", "2 + 3?"), _msg("assistant", "5"), _msg("user", "And 4 + 4?"),
          _msg("assistant", "8")]]),
    "prompt_completion": (
        [{"prompt": "What is 2 + 3?", "completion": "5."}],
        [[_msg("user", "What is 2 + 3?"), _msg("assistant", "5.")]]),
    "prompt_completion_conversational": (
        [{"prompt": [_msg("system", "Be brief."), _msg("user", "2 + 3?"),
                     _msg("assistant", "5"), _msg("user", "And 4 + 4?")],
          "completion": [_msg("assistant", "8")]}],
        [[_msg("system", "Be brief."), _msg("user", "2 + 3?"),
          _msg("assistant", "5", train=False), _msg("user", "And 4 + 4?"),
          _msg("assistant", "8")]]),
    "content_parts": (
        [{"messages": [_msg("system", _parts("Be ", "brief.")),
                       _msg("user", _parts("What is ", "2 + 3?")),
                       _msg("assistant", _parts("5", "."))]}],
        [[_msg("system", "Be brief."), _msg("user", "What is 2 + 3?"),
          _msg("assistant", "5.")]]),
}
TEXTS = [{"text": "Once upon a time there were 2 + 3 = 5 cats."},
         {"text": "A second document.\nWith two lines."}]
FORCED = [{"text": "Read me as text.", "prompt": "not a prompt", "completion": "no"}]
SHAPE_OF = {"sharegpt": "sharegpt", "alpaca": "alpaca", "prompt_completion": "prompt_completion",
            "prompt_completion_conversational": "prompt_completion",
            "content_parts": "messages", "json_array": "sharegpt", "text": "text",
            "forced_text": "text"}


def _write(path: Path, rows: list, array: bool = False) -> str:
    if array:
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prepare(tmp_path: Path, sources: list[dict], **data) -> dict:
    cfg = {"tokenizer": {"path": TOKENIZER},
           "data": {"format": "chat", "train": sources, "max_tokens_per_sample": 512, **data},
           "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "prepare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return prepare.run(load_recipe(path, PrepareConfig), show_progress=False)


def _rows(manifest: dict, name: str) -> list[dict]:
    (src,) = [s for s in manifest["sources"] if s["name"] == name]
    return [r for shard in src["shards"] for r in pq.read_table(shard["uri"]).to_pylist()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One prepare run: a source per shape, each beside a source of its messages equivalent."""
    d = tmp_path_factory.mktemp("shapes")
    sources = []
    for name, (rows, reference) in CASES.items():
        sources.append({"name": name, "path": _write(d / f"{name}.jsonl", rows)})
        sources.append({"name": f"{name}_ref", "path": _write(
            d / f"{name}_ref.jsonl", [{"messages": m} for m in reference])})
    sources += [{"name": "json_array", "path": _write(d / "sharegpt.json", CASES["sharegpt"][0],
                                                      array=True)},
                {"name": "text", "path": _write(d / "text.jsonl", TEXTS)},
                {"name": "forced_text", "path": _write(d / "forced.jsonl", FORCED),
                 "shape": "text"}]
    return _prepare(d, sources)


@pytest.mark.parametrize("name", list(CASES))
def test_shape_tokenizes_as_its_messages_equivalent(prepared, name):
    got, want = _rows(prepared, name), _rows(prepared, f"{name}_ref")
    assert len(got) == len(want) == len(CASES[name][1])
    for g, w in zip(got, want):
        assert g["input_ids"] == w["input_ids"] and g["loss_mask"] == w["loss_mask"]
        assert 0 < sum(g["loss_mask"]) < len(g["loss_mask"])


def test_json_array_file_reads_as_its_jsonl_twin(prepared):
    assert _rows(prepared, "json_array") == _rows(prepared, "sharegpt_ref")


def test_text_rows_are_documents_trained_on_every_token(prepared):
    """TRL's language-modelling rows: the tokenizer's ids (with its own special tokens) and
    EOS, no chat template, loss on every token."""
    hf = AutoTokenizer.from_pretrained(TOKENIZER)
    for name, rows in (("text", TEXTS), ("forced_text", FORCED)):
        got = _rows(prepared, name)
        want = [hf(r["text"])["input_ids"] + [hf.eos_token_id] for r in rows]
        assert [g["input_ids"] for g in got] == want
        assert [g["loss_mask"] for g in got] == [[1] * len(w) for w in want]
        assert "<|im_start|>" not in hf.decode(got[0]["input_ids"])


def test_manifest_records_each_sources_shape(prepared):
    shapes = {s["name"]: s["shape"] for s in prepared["sources"]}
    assert {k: v for k, v in shapes.items() if not k.endswith("_ref")} == SHAPE_OF
    assert {v for k, v in shapes.items() if k.endswith("_ref")} == {"messages"}


def test_a_source_mixing_shapes_names_both_and_the_row(tmp_path):
    reference = [{"messages": m} for m in CASES["sharegpt"][1]]
    path = _write(tmp_path / "mixed.json", [*reference, CASES["sharegpt"][0][0]], array=True)
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, [{"name": "m", "path": path}])
    msg = str(e.value)
    assert e.value.reason == "mixed_shapes" and "mixed.json:3" in msg
    assert "this row is sharegpt" in msg and "the source's rows are messages" in msg
    assert "mixed.json:1" in msg                    # where the source's shape was decided


def test_unknown_shape_names_the_shapes_and_keys_and_stops_even_when_skipping(tmp_path):
    path = _write(tmp_path / "qa.jsonl", [{"question": "2 + 3?", "answer": "5"}] * 2)
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, [{"name": "qa", "path": path}], on_bad_row="skip")
    msg = str(e.value)
    assert e.value.reason == "unknown_shape" and "qa.jsonl:1" in msg
    for shape in ("messages", "sharegpt", "prompt_completion", "alpaca", "text"):
        assert f"{shape}:" in msg
    assert "the row has keys: answer, question" in msg and "`shape:`" in msg
    assert "on_bad_row" not in msg


def test_forced_shape_must_be_one_of_the_formats(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train\[0\].shape: 'preference' is not a shape "
                                          r"of format chat"):
        _prepare(tmp_path, [{"name": "t", "path": str(tmp_path), "shape": "preference"}])
    with pytest.raises(ConfigError, match="'bot' maps to 'robot'"):
        _prepare(tmp_path, [{"name": "t", "path": str(tmp_path)}], role_map={"bot": "robot"})


def test_role_map_maps_other_speakers(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Yo"}]}]
    path = _write(tmp_path / "bot.jsonl", rows)
    with pytest.raises(DataError, match=r"unknown speaker 'bot'.*role_map: \{bot: assistant\}"):
        _prepare(tmp_path, [{"name": "b", "path": path}])
    manifest = _prepare(tmp_path, [{"name": "b", "path": path}], role_map={"bot": "assistant"})
    assert manifest["totals"]["rows_written"] == 1


def test_non_text_content_part_is_refused_by_name():
    row = {"messages": [_msg("user", [*_parts("What is this?"),
                                      {"type": "image_url", "image_url": {"url": "x.png"}}]),
                        _msg("assistant", "A cat.")]}
    with pytest.raises(DataError) as e:
        parse_row(row, FormatConfig("chat"), file="d.jsonl", line=4)
    assert e.value.reason == "non_text_content"
    assert "d.jsonl:4, field 'messages[0].content[1].type'" in str(e.value)
    assert "'image_url'" in str(e.value)


def _family_tokenizer(family: str):
    from tests.lib.data.test_tokenizer import hf_tokenizer
    return hf_tokenizer(family)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gemma4"])
def test_joined_parts_render_as_the_template_renders_the_list(family):
    """Templates that render content lists themselves (Qwen3.5, Gemma 3, Gemma 4) give the
    same text for the list and for the joined string, so the ids posttrain trains on are the
    ones an inference server builds from the list."""
    listed = [_msg("user", _parts("What is ", "2 + 3?")), _msg("assistant", _parts("It is ", "5.")),
              _msg("user", _parts("And ", "4 + 4?")), _msg("assistant", _parts("8", "."))]
    if family == "qwen3_5":
        listed.insert(0, _msg("system", _parts("Be ", "brief.")))
    hf = _family_tokenizer(family)
    cfg = FormatConfig("chat").with_template(hf)
    assert cfg.strip_text_parts == family.startswith("gemma")      # Gemma trims each part
    record = parse_row({"messages": listed}, cfg)
    assert all(isinstance(m["content"], str) for m in record.messages)
    rendered = hf.apply_chat_template(listed, tokenize=False)
    assert hf.apply_chat_template(record.messages, tokenize=False) == rendered
    tok = ChatTokenizer(TokenizerConfig(path=family), tokenizer=hf)
    assert tok.encode_chat(record.messages).input_ids == \
        hf(rendered, add_special_tokens=False)["input_ids"]


# --- prompt and preference rows -------------------------------------------------------------

PROMPT = FormatConfig("prompt")


@pytest.mark.parametrize("row", [
    {"prompt": [_msg("system", "Be brief."), _msg("user", "What is 2 + 3?")], "answer": "5"},
    {"system": "Be brief.", "conversations": [{"from": "human", "value": "What is 2 + 3?"}],
     "answer": "5"},
    {"instruction": "What is", "input": "2 + 3?", "system": "Be brief.", "answer": "5"},
    {"prompt": [_msg("system", _parts("Be ", "brief.")), _msg("user", _parts("What is 2 + 3?"))],
     "answer": "5"},
], ids=["prompt", "sharegpt", "alpaca", "content_parts"])
def test_prompt_shapes_give_the_same_prompt_and_extras(row):
    record = parse_row(row, PROMPT)
    assert isinstance(record, PromptRecord)
    user = "What is\n2 + 3?" if "instruction" in row else "What is 2 + 3?"
    assert record.prompt == [_msg("system", "Be brief."), _msg("user", user)]
    assert record.extras == {"answer": "5"}


def test_alpaca_prompt_keeps_output_as_an_extra_column():
    record = parse_row({"instruction": "2 + 3?", "output": "5", "id": 7}, PROMPT)
    assert record.prompt == [_msg("user", "2 + 3?")] and record.extras == {"output": "5", "id": 7}


def test_sharegpt_prompt_must_not_end_with_the_answer():
    row = {"conversations": [{"from": "human", "value": "2 + 3?"}, {"from": "gpt", "value": "5"}]}
    with pytest.raises(DataError, match=r"field 'conversations\[1\]': a prompt must not end"):
        parse_row(row, PROMPT, file="p.jsonl", line=1)


def test_preference_shapes_give_the_same_pair():
    prompt = [_msg("user", "What is 2 + 3?")]
    explicit = {"prompt": [_msg("user", _parts("What is ", "2 + 3?"))],
                "chosen": [_msg("assistant", _parts("5"))], "rejected": "6"}
    implicit = {"chosen": [*prompt, _msg("assistant", "5")],
                "rejected": [*prompt, _msg("assistant", "6")]}
    cfg = FormatConfig("preference")
    for row in (explicit, implicit):
        assert parse_row(row, cfg) == PreferenceRecord(prompt, [_msg("assistant", "5")],
                                                       [_msg("assistant", "6")])
    with pytest.raises(DataError, match="share no leading message"):
        parse_row({"chosen": [_msg("assistant", "5")], "rejected": [_msg("assistant", "6")]}, cfg)
