"""posttrain.lineage: canonical config hashing, code versions, Metaflow tags, tree walking and
rendering. Traversal is checked here with an in-memory loader; the real chain of Metaflow
runs is checked in tests/flows/test_lineage_flow.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from posttrain.lineage import (MAX_LINEAGE_TAGS, LineageError, build_lineage, canonical_json,
                               code_label, code_version, config_hash, dataset_ref, format_tree,
                               lineage_card_spec, raw_dataset_ref, tags_for, tree_hash,
                               walk)

CFG = {"train": {"max_steps": 10, "optimizer": {"lr": 0.003, "betas": [0.9, 0.95]}},
       "data": {"format": "chat", "train": [{"path": "a.jsonl", "name": "a"}]},
       "model": {"hf_dir": None}}


def _reordered(obj):
    if isinstance(obj, dict):
        return {k: _reordered(obj[k]) for k in reversed(list(obj))}
    return obj


def _changes(obj, path=()):
    """Every leaf of `obj` changed once: (path, copy with that one value changed)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            for p, changed in _changes(v, path + (k,)):
                yield p, {**obj, k: changed}
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            for p, changed in _changes(v, path + (i,)):
                yield p, [*obj[:i], changed, *obj[i + 1:]]
    elif isinstance(obj, bool) or obj is None:
        yield path, 0
    elif isinstance(obj, (int, float)):
        yield path, obj + 1
    else:
        yield path, str(obj) + "x"


def test_config_hash_ignores_key_order_and_sees_every_value():
    h = config_hash(CFG)
    assert len(h) == 64 and h == config_hash(_reordered(CFG))
    assert json.dumps(_reordered(CFG)) != json.dumps(CFG)      # the order did change
    changed = list(_changes(CFG))
    assert len(changed) >= 6
    for path, cfg in changed:
        assert config_hash(cfg) != h, path
    # a value's type counts: 1 and 1.0 and "1" are different configs
    assert len({config_hash({"x": v}) for v in (1, 1.0, "1", True)}) == 4
    # a renamed key counts
    assert config_hash({"lr": 1}) != config_hash({"learning_rate": 1})


def test_canonical_json_refuses_what_it_cannot_write_stably():
    with pytest.raises(TypeError):
        canonical_json({"x": object()})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def _lineage(pathspec, parents=(), content_hash="ab" * 32, cfg=CFG, outputs=None):
    return build_lineage(
        pathspec, config=cfg,
        datasets=[dataset_ref(prepared_uri=f"/runs/{pathspec}/prepared",
                              content_hash=content_hash, config_hash="cd" * 32,
                              sources=[{"split": "train", "name": "a", "path": "a.jsonl",
                                        "content_hash": "ef" * 32, "rows": 3}])],
        code={"kind": "git", "commit": "0123456789abcdef" * 2 + "01234567", "dirty": True},
        outputs={"hf_uri": f"/runs/{pathspec}/hf"} if outputs is None else outputs,
        parents=parents)


def test_build_lineage_records_the_config_hash_and_drops_missing_parents():
    lin = _lineage("GRPOFlow/2", parents=[None, "SFTFlow/1"])
    d = lin.to_dict()
    assert d["parents"] == ["SFTFlow/1"] and lin.flow == "GRPOFlow" and lin.run_id == "2"
    assert d["config_hash"] == config_hash(CFG) and d["config"] == CFG
    assert json.loads(json.dumps(d)) == d                       # a plain, JSON-able record
    with pytest.raises(LineageError, match="not a run pathspec"):
        _lineage("SFTFlow/1/end")
    with pytest.raises(LineageError, match="not a run pathspec"):
        _lineage("GRPOFlow/2", parents=["SFTFlow"])
    with pytest.raises(ValueError, match="no content hash"):
        dataset_ref(prepared_uri="/p", content_hash="", config_hash="")


def test_raw_dataset_hash_follows_the_rows_not_the_location(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "eval.jsonl").write_text('{"x": 1}\n')
    (b / "eval.jsonl").write_text('{"x": 1}\n')
    ref = raw_dataset_ref("t", str(a / "eval.jsonl"))
    assert ref["content_hash"] == raw_dataset_ref("t", str(b / "eval.jsonl"))["content_hash"]
    assert ref["sources"][0]["path"] == str(a / "eval.jsonl") and ref["prepared_uri"] is None
    (b / "eval.jsonl").write_text('{"x": 2}\n')
    assert ref["content_hash"] != raw_dataset_ref("t", str(b / "eval.jsonl"))["content_hash"]
    both = raw_dataset_ref("t", [str(a / "eval.jsonl"), str(b / "eval.jsonl")])
    assert both["sources"][0]["files"] == 2 and both["content_hash"] != ref["content_hash"]


def test_tags_name_dataset_config_code_model_and_parents_within_metaflow_limits():
    from metaflow.tagging_util import MAX_USER_TAG_SET_SIZE, validate_tags
    lin = _lineage("GRPOFlow/2", parents=["SFTFlow/1"])
    tags = tags_for(lin)
    assert tags == [f"dataset:{'ab' * 6}", f"config:{config_hash(CFG)[:12]}",
                    "code:0123456+dirty", "model:GRPOFlow/2", "parent:SFTFlow/1"]
    assert tags_for(lin.to_dict()) == tags
    validate_tags(tags)                                         # Metaflow's own check
    # no model produced: no model tag
    assert not any(t.startswith("model:") for t in tags_for(_lineage("X/1", outputs={})))
    # many parents: capped, with a warning, inside Metaflow's limit on a run's tag set
    many = _lineage("EvalFlow/9", parents=[f"SFTFlow/{i}" for i in range(80)])
    with pytest.warns(UserWarning, match="dropped"):
        capped = tags_for(many)
    assert len(capped) == MAX_LINEAGE_TAGS < MAX_USER_TAG_SET_SIZE
    validate_tags(capped)
    # a tag over Metaflow's 500 characters is dropped, not sent
    with pytest.warns(UserWarning, match="longer than"):
        long = tags_for(_lineage("EvalFlow/9", parents=["SFTFlow/" + "9" * 600]))
    validate_tags(long)
    assert not any(t.startswith("parent:") for t in long)


def test_code_version_of_a_git_checkout_a_package_and_a_plain_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "lib").mkdir(parents=True)
    (repo / "lib" / "a.py").write_text("x = 1\n")
    plain = code_version(repo, None)
    assert plain == {"kind": "tree", "sha": tree_hash(str(repo))}
    assert code_label(plain).startswith("tree:")
    package = code_version(repo, {"sha": "f" * 40, "info": {"commit_sha": "a" * 40,
                                                           "has_uncommitted_changes": False}})
    assert package == {"kind": "code-package", "sha": "f" * 40, "commit": "a" * 40,
                       "dirty": False}
    assert code_label(package) == "aaaaaaa"

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    clean = code_version(repo, None)
    assert clean["kind"] == "git" and clean["dirty"] is False and len(clean["commit"]) == 40
    (repo / "lib" / "a.py").write_text("x = 2\n")
    dirty = code_version(repo, None)
    assert dirty["commit"] == clean["commit"] and dirty["dirty"] is True
    assert code_label(dirty) == clean["commit"][:7] + "+dirty"
    (repo / "lib" / "a.py").write_text("x = 3\n")
    assert code_version(repo, None)["diff_hash"] != dirty["diff_hash"]
    # the plain tree hash sees the same change
    assert tree_hash(str(repo)) != plain["sha"]


class _Store:
    """Lineage dicts by pathspec; `load` raises LineageError like the Metaflow loader."""

    def __init__(self, *lineages):
        self.by_pathspec = {lin.pathspec: lin.to_dict() for lin in lineages}
        self.loaded: list[str] = []

    def load(self, pathspec):
        self.loaded.append(pathspec)
        if pathspec not in self.by_pathspec:
            raise LineageError(f"{pathspec}: no such run")
        return self.by_pathspec[pathspec]


def test_walk_follows_parents_and_keeps_going_past_a_missing_one():
    sft = _lineage("SFTFlow/1", content_hash="11" * 32)
    dpo = _lineage("DPOFlow/2", parents=["SFTFlow/1"], content_hash="22" * 32)
    ev = _lineage("EvalFlow/3", parents=["DPOFlow/2", "SFTFlow/1", "SFTFlow/0"],
                  content_hash="33" * 32, outputs={"eval_uri": "/e.json"})
    store = _Store(sft, dpo, ev)
    tree = walk("EvalFlow/3", store.load)
    assert [p["pathspec"] for p in tree["parents"]] == ["DPOFlow/2", "SFTFlow/1", "SFTFlow/0"]
    dpo_node, sft_node, missing = tree["parents"]
    assert dpo_node["parents"][0]["pathspec"] == "SFTFlow/1"
    assert dpo_node["parents"][0]["lineage"]["datasets"][0]["content_hash"] == "11" * 32
    assert sft_node["seen"] is True and sft_node["parents"] == []   # shown once, not twice
    assert missing["lineage"] is None and "no such run" in missing["error"]
    # the root given in hand (a run's own end step) is not loaded
    store.loaded.clear()
    walk("EvalFlow/3", store.load, root=ev.to_dict())
    assert "EvalFlow/3" not in store.loaded
    with pytest.raises(LineageError, match="no such run"):
        walk("NoFlow/1", store.load)
    # a cycle (a corrupt store) is reported, not followed forever
    loop_a = _lineage("AFlow/1", parents=["BFlow/1"])
    loop_b = _lineage("BFlow/1", parents=["AFlow/1"])
    with pytest.raises(LineageError, match="cycle"):
        walk("AFlow/1", _Store(loop_a, loop_b).load)


def test_format_tree_of_a_hand_built_tree():
    sft = _lineage("SFTFlow/1", content_hash="1a2b3c4d5e6f" + "0" * 52)
    grpo = _lineage("GRPOFlow/2", parents=["SFTFlow/1"], content_hash="aa" * 32)
    tree = {"pathspec": "GRPOFlow/2", "lineage": grpo.to_dict(), "error": None, "seen": False,
            "parents": [{"pathspec": "SFTFlow/1", "lineage": sft.to_dict(), "error": None,
                         "seen": False, "parents": []},
                        {"pathspec": "SFTFlow/0", "lineage": None, "error": "no such run",
                         "seen": False, "parents": []}]}
    h = config_hash(CFG)[:12]
    assert format_tree(tree, details=False).splitlines() == [
        f"GRPOFlow/2 (dataset {'aa' * 6}, config {h}, code 0123456+dirty)",
        f"├─ SFTFlow/1 (dataset 1a2b3c4d5e6f, config {h}, code 0123456+dirty)",
        "└─ SFTFlow/0 (no lineage: no such run)",
    ]
    full = format_tree(tree).splitlines()
    assert full[0].startswith("GRPOFlow/2 (dataset")
    assert "├─ data train/a: a.jsonl" in full
    assert "├─ hf_uri: /runs/GRPOFlow/2/hf" in full
    sft_line = full.index(
        f"├─ SFTFlow/1 (dataset 1a2b3c4d5e6f, config {h}, code 0123456+dirty)")
    assert full[sft_line + 1] == "│  ├─ data train/a: a.jsonl"
    assert full[-1] == "└─ SFTFlow/0 (no lineage: no such run)"


def test_card_spec_has_the_tree_a_row_per_run_and_a_graph_with_an_edge_per_parent():
    sft = _lineage("SFTFlow/1")
    grpo = _lineage("GRPOFlow/2", parents=["SFTFlow/1"])
    tree = walk("GRPOFlow/2", _Store(sft, grpo).load)
    spec = lineage_card_spec(tree)
    assert spec["tree_text"] == format_tree(tree)
    assert [r[0] for r in spec["table"]["rows"]] == ["GRPOFlow/2", "SFTFlow/1"]
    assert spec["table"]["rows"][0][4] == "SFTFlow/1"
    assert len(spec["table"]["headers"]) == len(spec["table"]["rows"][0])
    layers = spec["graph"]["layer"]
    assert layers[0]["data"]["values"] == [{"x": 0, "y": 0, "x2": 1, "y2": 1}]
    assert [n["run"] for n in layers[1]["data"]["values"]] == ["GRPOFlow/2", "SFTFlow/1"]
    json.dumps(spec)
