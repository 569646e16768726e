"""The verifier's report and the `posttrain verify-model` entry point."""

from __future__ import annotations

import json

import pytest
import torch

import posttrain.models.verify as verify_mod
from posttrain.errors import ConfigError
from posttrain.models.verify import main, tiny_hf_config, verify


def test_report_fields(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("qwen3")
    report = verify(hf_dir, seq_len=16, batch=2, packed=True, seed=2)
    assert report["passed"] and report["padding_logits_neg_inf"]
    for part in ("unpacked", "packed"):
        assert set(report[part]) >= {"max_abs_diff", "kl_max", "kl_mean"}
        assert report[part]["max_abs_diff"] <= 1e-4
    assert all(sum(row) == 16 for row in report["packed"]["document_lengths"])
    json.dumps(report)


def test_cli_passes_on_a_family_config(capsys) -> None:
    code = main(["--family", "gemma3", "--config", '{"num_hidden_layers": 2, '
                 '"layer_types": ["sliding_attention", "full_attention"]}',
                 "--seq-len", "20", "--packed"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["family"] == "gemma3"


def test_cli_fails_when_weights_are_perturbed(make_hf_dir, monkeypatch, capsys) -> None:
    hf_dir, _ = make_hf_dir("llama")
    assert main(["--hf-dir", str(hf_dir), "--seq-len", "16"]) == 0
    capsys.readouterr()
    real_load = verify_mod.load_hf

    def perturbed_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        with torch.no_grad():
            model.layers[1].attn.v.weight.add_(1e-3)
        return model

    monkeypatch.setattr(verify_mod, "load_hf", perturbed_load)
    assert main(["--hf-dir", str(hf_dir), "--seq-len", "16"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"] and report["unpacked"]["max_abs_diff"] > 1e-4


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="no tiny config"):
        tiny_hf_config("mistral")
    with pytest.raises(SystemExit):
        main(["--hf-dir", "x", "--config", "{}"])


def test_deepseek_tiny_config_ignores_overrides_mla_derives() -> None:
    """`model.init.family: deepseek_v3` over overrides written for a GQA family (the bundled
    configs/sft/tiny.yaml: head_dim 32, 2 key/value heads) still makes a model transformers and
    the bridge accept: MLA's head_dim is its rope part, its key/value heads are its heads."""
    from posttrain.models import args_from_hf_config

    cfg = tiny_hf_config("deepseek_v3", hidden_size=128, head_dim=32, num_attention_heads=4,
                         num_key_value_heads=2)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (cfg.qk_rope_head_dim, 4)
    args = args_from_hf_config(cfg.to_dict())
    assert (args.head_dim, args.num_kv_heads, args.hidden_size) == (cfg.qk_rope_head_dim, 4, 128)


def test_cli_names_a_missing_checkpoint_in_one_line(tmp_path, capsys) -> None:
    from steps.cli import main as cli_main
    assert cli_main(["verify-model", "--hf-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain verify-model: error:") and "config.json not found" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
