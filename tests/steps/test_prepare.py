"""steps/prepare.py end to end: counts, rejects, parity with apply_chat_template, s3 (also
across an outage of the endpoint), CLI."""

import gc
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from posttrain.config.recipes import PrepareConfig, load_recipe
from posttrain.data.sources import RowStream
from posttrain.errors import ConfigError, DataError
from steps import prepare

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "assets" / "tokenizer")

GOOD = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "content": "2 + 3 = 5."},
                     {"role": "user", "content": "And 4 + 4?"},
                     {"role": "assistant", "content": "4 + 4 = 8."}]}

# (raw line, expected reason, expected field) for every bad-input case of the issue.
BAD_LINES = [
    (b'{"messages": [{"role": "user", "content": "x"}', "invalid_json", None),
    (json.dumps({"conversation": []}).encode(), "missing_field", "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"},
                              {"role": "assistant", "content": "y"}]}).encode(),
     "bad_role", "messages[0].role"),
    (json.dumps({"messages": []}).encode(), "empty", "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),
     "no_assistant_turn", "messages"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid_utf8", None),
    (json.dumps({"messages": [{"role": "user", "content": "long " * 400},
                              {"role": "assistant", "content": "ok"}]}).encode(),
     "too_long", "messages"),
    (b'[1, 2, 3]', "not_an_object", None),
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "too_deep", None),
    (b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", "too_deep", "messages"),
]

PAIR = {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
PROMPT = {"prompt": "What is 2 + 3?", "answer": "5"}
UNPAIRED = {"prompt": "What is 2 + 3?", "completion": "5", "label": True}

# (format, a good row, raw bad line, expected reason, expected field) for the odd rows of the
# preference, unpaired and prompt formats; prompt rows are prepared with required_columns:
# [answer].
ODD_LINES = [
    ("preference", PAIR, json.dumps({**PAIR, "rejected": "5"}).encode(), "identical_pair",
     "rejected"),
    ("unpaired", UNPAIRED, json.dumps({"prompt": "q", "completion": "5"}).encode(),
     "missing_field", "label"),
    ("unpaired", UNPAIRED, json.dumps({**UNPAIRED, "label": 1}).encode(), "wrong_type", "label"),
    ("unpaired", UNPAIRED, json.dumps({**UNPAIRED, "label": "false"}).encode(), "wrong_type",
     "label"),
    ("prompt", PROMPT, json.dumps({"prompt": "What is 2 + 3?", "id": 7}).encode(),
     "missing_field", "answer"),
    ("prompt", PROMPT, b'{"prompt": "What is 2 + 3?", "answer": NaN}', "non_finite", "answer"),
    ("prompt", PROMPT, b'{"prompt": "q", "answer": "5", "meta": {"w": [1, -Infinity]}}',
     "non_finite", "meta.w[1]"),
    ("prompt", PROMPT, b'{"prompt": "q", "answer": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "too_deep", None),
]


def _write_jsonl(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def _config(tmp_path: Path, train_path: str, **data) -> PrepareConfig:
    cfg = {"tokenizer": {"path": TOKENIZER},
           "data": {"format": "chat", "train": [{"name": "t", "path": train_path}],
                    "max_tokens_per_sample": 256, "overlong": "drop", **data},
           "output": {"dir": str(tmp_path / "out"), "rows_per_shard": 3}}
    path = tmp_path / "prepare.yaml"
    import yaml
    path.write_text(yaml.safe_dump(cfg))
    return load_recipe(path, PrepareConfig)


def _read_rows(manifest: dict, split="train") -> list[dict]:
    rows = []
    for src in manifest["sources"]:
        if src["split"] == split:
            for shard in src["shards"]:
                rows += pq.read_table(shard["uri"]).to_pylist()
    return rows


def test_skip_counts_and_reports_every_bad_row(tmp_path):
    good = json.dumps(GOOD).encode()
    lines = [good] + [line for line, _, _ in BAD_LINES] + [good, good]
    _write_jsonl(tmp_path / "train.jsonl", lines)
    manifest = prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl"),
                                   on_bad_row="skip"), show_progress=False)
    src = manifest["sources"][0]
    assert src["rows_read"] == len(lines)
    assert src["rows_written"] == 3 and src["rows_rejected"] == len(BAD_LINES)
    assert src["rows_read"] == src["rows_written"] + src["rows_rejected"]
    assert len(src["shards"]) == 1 and src["shards"][0]["rows"] == 3
    assert gc.get_freeze_count() == 0     # what prepare froze for its run is unfrozen

    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == [reason for _, reason, _ in BAD_LINES]
    assert [r["line"] for r in rejects] == list(range(2, 2 + len(BAD_LINES)))
    for r, (_, _, field) in zip(rejects, BAD_LINES):
        assert r["file"].endswith("train.jsonl")
        if field:
            assert r["field"] == field


@pytest.mark.parametrize("line, reason, field", BAD_LINES, ids=[b[1] for b in BAD_LINES])
def test_error_mode_names_file_line_and_field(tmp_path, line, reason, field):
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(GOOD).encode(), line])
    with pytest.raises(DataError) as e:
        prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl")), show_progress=False)
    msg = str(e.value)
    assert "train.jsonl:2" in msg and e.value.reason == reason
    if field:
        assert f"field '{field}'" in msg
    assert "on_bad_row: skip" in msg
    assert gc.get_freeze_count() == 0     # unfrozen on the way out of an error too


def _odd_config(tmp_path: Path, fmt: str, **data) -> PrepareConfig:
    if fmt == "prompt":
        data["required_columns"] = ["answer"]
    return _config(tmp_path, str(tmp_path / "train.jsonl"), format=fmt, **data)


@pytest.mark.parametrize("fmt, good, line, reason, field", ODD_LINES,
                         ids=[f"{o[0]}-{o[3]}" for o in ODD_LINES])
def test_odd_rows_are_counted_rejects(tmp_path, fmt, good, line, reason, field):
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(good).encode(), line,
                                            json.dumps(good).encode()])
    manifest = prepare.run(_odd_config(tmp_path, fmt, on_bad_row="skip"), show_progress=False)
    src = manifest["sources"][0]
    assert (src["rows_read"], src["rows_written"], src["rows_rejected"]) == (3, 2, 1)
    assert src["rows_read"] == src["rows_written"] + src["rows_rejected"]
    assert src["rejected_by_reason"] == {reason: 1}
    (reject,) = [json.loads(x) for x in
                 (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert reject["file"].endswith("train.jsonl") and reject["line"] == 2
    assert (reject["reason"], reject["field"]) == (reason, field)
    assert f"{reason}=1" in prepare.summarize(manifest)


@pytest.mark.parametrize("fmt, good, line, reason, field", ODD_LINES,
                         ids=[f"{o[0]}-{o[3]}" for o in ODD_LINES])
def test_odd_rows_in_error_mode_name_file_line_and_field(tmp_path, fmt, good, line, reason,
                                                         field):
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(good).encode(), line])
    with pytest.raises(DataError) as e:
        prepare.run(_odd_config(tmp_path, fmt), show_progress=False)
    msg = str(e.value)
    assert "train.jsonl:2" in msg and e.value.reason == reason and "on_bad_row: skip" in msg
    if field:
        assert f"field '{field}'" in msg


def test_identical_pairs_are_kept_when_allowed(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(PAIR).encode(),
                                            json.dumps({**PAIR, "rejected": "5"}).encode()])
    manifest = prepare.run(_odd_config(tmp_path, "preference", allow_identical_pairs=True),
                           show_progress=False)
    t = manifest["totals"]
    assert (t["rows_read"], t["rows_written"], t["rows_rejected"]) == (2, 2, 0)


def test_unpaired_rows_tokenize_as_the_sides_of_a_pair(tmp_path):
    """KTO's rows: each completion gets the ids and loss mask of the same response in a
    preference pair, and its label as the shard's desirable column."""
    rows = [{"prompt": PAIR["prompt"], "completion": PAIR[side], "label": side == "chosen"}
            for side in ("chosen", "rejected")]
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(r).encode() for r in rows])
    unpaired = _read_rows(prepare.run(_odd_config(tmp_path, "unpaired"), show_progress=False))
    (tmp_path / "pairs").mkdir()
    _write_jsonl(tmp_path / "pairs" / "train.jsonl", [json.dumps(PAIR).encode()])
    (pair,) = _read_rows(prepare.run(_odd_config(tmp_path / "pairs", "preference"),
                                     show_progress=False))
    for row, side in zip(unpaired, ("chosen", "rejected")):
        assert row["input_ids"] == pair[f"{side}_input_ids"]
        assert row["loss_mask"] == pair[f"{side}_loss_mask"] and sum(row["loss_mask"]) > 0
        assert row["desirable"] is (side == "chosen")


def test_grpo_launch_prepares_only_rows_with_the_rewards_columns(tmp_path, monkeypatch):
    """The GRPO recipe's data, prepared the way its launch does (`ensure_prepared`), refuses a
    row without the `answer` that exact_match_number reads."""
    from posttrain.train.grpo import GRPOConfig
    from steps.common import ensure_prepared
    monkeypatch.chdir(ROOT)
    lines = [PROMPT, {"prompt": "What is 1 + 1?"}, {"prompt": "What is 2 + 2?", "solution": 4},
             PROMPT]
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(r).encode() for r in lines])
    data = {"data.train": [{"name": "t", "path": str(tmp_path / "train.jsonl")}], "data.eval": []}
    cfg = load_recipe("configs/grpo/tiny.yaml", GRPOConfig,
                      {**data, "data.on_bad_row": "skip"})
    ensure_prepared(cfg, str(tmp_path / "skip"), show_progress=False)
    manifest = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    t = manifest["totals"]
    assert (t["rows_read"], t["rows_written"], t["rows_rejected"]) == (4, 2, 2)
    assert manifest["sources"][0]["rejected_by_reason"] == {"missing_field": 2}
    rejects = [json.loads(x) for x in
               (tmp_path / "skip" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"]) for r in rejects] == [(2, "answer"), (3, "answer")]
    assert all("column 'answer' is missing" in r["message"] for r in rejects)

    cfg = load_recipe("configs/grpo/tiny.yaml", GRPOConfig, data)
    with pytest.raises(DataError, match=r"train.jsonl:2, field 'answer': column 'answer' is "
                                        r"missing, but the reward functions read it"):
        ensure_prepared(cfg, str(tmp_path / "error"), show_progress=False)


@pytest.mark.parametrize("data, says", [
    ({"required_columns": ["answer"]}, "data.required_columns applies to data.format: prompt"),
    ({"allow_identical_pairs": True},
     "data.allow_identical_pairs applies to data.format: preference"),
])
def test_format_options_on_the_wrong_format_are_refused(tmp_path, data, says):
    with pytest.raises(ConfigError, match=says):
        _config(tmp_path, "x.jsonl", **data)


def test_ids_equal_apply_chat_template_and_mask_on_assistant(tmp_path):
    convs = [GOOD, {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello there"}]}]
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(c).encode() for c in convs])
    manifest = prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl")), show_progress=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    rows = _read_rows(manifest)
    for conv, row in zip(convs, rows):
        ids = tok.apply_chat_template(conv["messages"], tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert row["input_ids"] == list(ids)
        masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        expected = "".join(m["content"] + "<|im_end|>" for m in conv["messages"]
                           if m["role"] == "assistant")
        assert masked == expected
        assert row["num_loss_tokens"] == sum(row["loss_mask"])


def test_truncate_keeps_beginning_and_counts(tmp_path):
    conv = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "word " * 300}]}
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(conv).encode()])
    manifest = prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl"), overlong="truncate",
                                   max_tokens_per_sample=64), show_progress=False)
    (row,) = _read_rows(manifest)
    assert row["num_tokens"] == 64 and manifest["sources"][0]["rows_truncated"] == 1


def test_content_hash_is_deterministic(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [json.dumps(GOOD).encode()] * 5)
    a = prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl")), show_progress=False)
    b = prepare.run(_config(tmp_path, str(tmp_path / "train.jsonl")), show_progress=False)
    assert a["content_hash"] == b["content_hash"] and a["config_hash"] == b["config_hash"]
    assert sum(a["sources"][0]["length_histogram"].values()) == 5


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        prepare.run(_config(tmp_path, str(tmp_path / "nope.jsonl")), show_progress=False)


def test_bad_config_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tokenizer: {path: x}\ndata: {train: [{path: a.jsonl}], formatt: chat}\n"
                    "output: {dir: out}\n")
    with pytest.raises(ConfigError, match=r"data\.formatt: unknown key \(did you mean 'format'"):
        load_recipe(path, PrepareConfig)


def test_cli_prints_one_clear_line_not_a_trace(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tokenizer: {path: x}\ndata: {train: [{path: a.jsonl}]}\noutput: {dir: o}\n"
                    "extra: 1\n")
    proc = subprocess.run([sys.executable, "-m", "steps.cli", "prepare", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "extra: unknown key" in proc.stderr and "Traceback" not in proc.stderr


def test_s3_in_and_out(tmp_path, s3):
    s3.put("raw/chat/part-0.jsonl", (json.dumps(GOOD) + "\n").encode() * 4)
    s3.put("raw/chat/part-1.jsonl", (json.dumps(GOOD) + "\n").encode() * 3)
    cfg = _config(tmp_path, f"s3://{s3.bucket}/raw/chat/*.jsonl")
    cfg = load_recipe(tmp_path / "prepare.yaml", PrepareConfig,
                      {"output.dir": f"s3://{s3.bucket}/prepared"})
    manifest = prepare.run(cfg, show_progress=False)
    assert manifest["totals"]["rows_written"] == 7
    assert all(sh["uri"].startswith("s3://") for sh in manifest["sources"][0]["shards"])
    local = prepare.run(_config(tmp_path, str(_local_copy(tmp_path, 7))), show_progress=False)
    assert local["content_hash"] == manifest["content_hash"]


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                         {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]}


def test_s3_outage_while_streaming_loses_and_repeats_no_row(tmp_path, s3, s3_outage, caplog,
                                                           monkeypatch):
    """The endpoint goes down for 2.5 s in the middle of the third of six files; prepare (with
    the default RetryConfig) waits it out, and its manifest equals an uninterrupted run's."""
    for f in range(6):
        s3.put(f"raw/outage/part-{f}.jsonl",
               "".join(json.dumps(_chat(40 * f + i)) + "\n" for i in range(40)).encode())
    files = [s3.uri(f"raw/outage/part-{f}.jsonl") for f in range(6)]
    # s3fs reads 2 kB per request (files are ~4 kB), so the outage meets reads mid-file
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 2048})
    _config(tmp_path, s3.uri("raw/outage/*.jsonl"))

    def run(out: str) -> dict:
        cfg = load_recipe(tmp_path / "prepare.yaml", PrepareConfig,
                          {"output.dir": str(tmp_path / out), "output.rows_per_shard": 50})
        return prepare.run(cfg, show_progress=False)

    plain = run("plain")
    rows_seen, reached = [0], threading.Event()
    emit = RowStream._emit

    def counting_emit(self, row):
        rows_seen[0] += 1
        if rows_seen[0] == 100:
            reached.set()
        return emit(self, row)

    monkeypatch.setattr(RowStream, "_emit", counting_emit)
    outage = threading.Thread(target=lambda: reached.wait(60) and s3_outage.go_down(2.5))
    outage.start()
    try:
        with caplog.at_level(logging.WARNING, logger="posttrain.data.sources"):
            flaky = run("flaky")
    finally:
        reached.set()
        outage.join()
    assert s3_outage.outages == 1 and rows_seen[0] == 240
    warnings = [r.getMessage() for r in caplog.records if "transient storage error" in
                r.getMessage()]
    assert warnings and all(m.split(": transient")[0] in files for m in warnings)

    assert flaky["content_hash"] == plain["content_hash"]
    assert flaky["totals"] == plain["totals"]
    assert plain["totals"]["rows_read"] == plain["totals"]["rows_written"] == 240
    for a, b in zip(flaky["sources"], plain["sources"], strict=True):
        assert a["content_hash"] == b["content_hash"] and a["files"] == b["files"] == files
        assert [(s["rows"], s["bytes"]) for s in a["shards"]] == [
            (s["rows"], s["bytes"]) for s in b["shards"]]
    rows = _read_rows(flaky)
    assert rows == _read_rows(plain) and len(rows) == 240


def _local_copy(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "local.jsonl"
    path.write_text((json.dumps(GOOD) + "\n") * n)
    return path


@pytest.mark.parametrize("name", ["sample_chat", "sample_preference",
                                  "sample_arithmetic_prompts"])
def test_bundled_configs_run(tmp_path, name, monkeypatch):
    monkeypatch.chdir(ROOT)
    manifest = prepare.run(f"configs/prepare/{name}.yaml",
                           overrides={"output.dir": str(tmp_path / name)}, show_progress=False)
    t = manifest["totals"]
    assert t["rows_written"] > 0 and t["rows_read"] == t["rows_written"] + t["rows_rejected"]
    assert manifest["tokenizer"]["vocab_size"] > 0
    assert "read =" in prepare.summarize(manifest)
