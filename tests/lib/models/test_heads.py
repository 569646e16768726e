"""posttrain.models.heads: shapes, names, and the saved heads loaded back with equal outputs."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models.heads import (HEADS_FILE, HEADS_JSON, HeadConfig, PositionHeads,
                                    load_heads, save_heads)

CONFIGS = {"kind": HeadConfig("classification", num_classes=4, weight=0.5),
           "dwell": HeadConfig("regression", target="current")}


def test_outputs_and_parameter_names():
    torch.manual_seed(0)
    heads = PositionHeads(CONFIGS, 16)
    out = heads(torch.randn(2, 5, 16))
    assert out["kind"].shape == (2, 5, 4) and out["dwell"].shape == (2, 5)
    assert sorted(heads.state_dict()) == ["dwell.bias", "dwell.weight", "kind.bias",
                                          "kind.weight"]


def test_saved_heads_load_back_with_equal_outputs(tmp_path):
    torch.manual_seed(0)
    heads = PositionHeads(CONFIGS, 16)
    save_heads(tmp_path, dict(heads.state_dict()), CONFIGS, 16)
    meta = json.loads((tmp_path / HEADS_JSON).read_text())
    assert meta["weights"] == HEADS_FILE and meta["hidden_size"] == 16
    assert meta["heads"]["dwell"] == {"kind": "regression", "num_classes": None,
                                      "target": "current", "weight": 1.0}
    loaded = load_heads(tmp_path)
    assert loaded.configs == CONFIGS and not loaded.training
    h = torch.randn(3, 16)
    with torch.no_grad():
        for name, want in heads(h).items():
            assert torch.equal(loaded(h)[name], want)
    with pytest.raises(ValueError, match="do not match the heads"):
        save_heads(tmp_path, {"kind.weight": torch.zeros(4, 16)}, CONFIGS, 16)
    with pytest.raises(FileNotFoundError, match=HEADS_JSON):
        load_heads(tmp_path / "nowhere")


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "classification"}, "a head of kind classification needs num_classes >= 2"),
    ({"kind": "classification", "num_classes": 1}, "needs num_classes >= 2"),
    ({"kind": "regression", "num_classes": 3}, "a head of kind regression has no num_classes"),
    ({"kind": "regression", "weight": -1.0}, "must be >= 0"),
])
def test_bad_head_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HeadConfig(**kwargs)


def test_head_names_must_not_shadow_module_attributes():
    with pytest.raises(ConfigError, match="head name 'forward'"):
        PositionHeads({"forward": HeadConfig("regression")}, 8)
