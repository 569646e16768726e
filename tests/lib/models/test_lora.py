"""LoRA: init equals base, merge/unmerge, frozen base, disable_adapters, PEFT and merged export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from posttrain.errors import ConfigError
from posttrain.models import load_hf
from posttrain.models.lora import (LoRALinear, LoraConfig, apply_lora, disable_adapters,
                                   flops_kwargs, lora_modules, lora_state_dict, merge_lora,
                                   save_merged_hf, save_peft_adapter, unmerge_lora)

FAMILIES = ("qwen3", "llama")
VOCAB = 250


def _ids(seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids))[..., :VOCAB]


def _randomize_b(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.copy_(0.05 * torch.randn(m.lora_B.shape, generator=gen))


def _train(model: torch.nn.Module, steps: int = 3) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = _ids(seed=5)
    for _ in range(steps):
        logits = model.logits(model(ids[:, :-1]))[..., :VOCAB]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture
def lora_model(make_hf_dir):
    def make(family: str, **cfg):
        hf_dir, ref = make_hf_dir(family)
        model = load_hf(hf_dir, dtype=torch.float32).eval()
        base_logits = _logits(model, _ids())
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, init_seed=0, **cfg))
        return hf_dir, ref, model, base_logits
    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_init_equals_base_and_only_adapters_train(family, lora_model) -> None:
    _, _, model, base_logits = lora_model(family)
    assert torch.equal(_logits(model, _ids()), base_logits)        # B = 0 at init
    wrapped = {n for n, _ in lora_modules(model)}
    assert len(wrapped) == 2 * 7 and "layers.1.mlp.down" in wrapped
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 2 * 2 * 7
    # native parameter names of the base are unchanged by wrapping
    assert "layers.0.attn.q.weight" in dict(model.named_parameters())

    _train(model, steps=2)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert not torch.allclose(_logits(model, _ids()), base_logits, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_unmerge_and_disable(family, lora_model) -> None:
    _, _, model, base_logits = lora_model(family)
    _randomize_b(model)
    ids = _ids()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapted = _logits(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-2                # the check is not vacuous

    with disable_adapters(model):
        assert torch.equal(_logits(model, ids), base_logits)
    assert torch.equal(_logits(model, ids), adapted)                  # restored on exit

    merge_lora(model)
    assert all(m.merged for _, m in lora_modules(model))
    assert (_logits(model, ids) - adapted).abs().max() <= 1e-5
    with disable_adapters(model):                                      # also while merged
        assert (_logits(model, ids) - base_logits).abs().max() <= 1e-5
    unmerge_lora(model)
    assert not any(m.merged for _, m in lora_modules(model))
    for n, p in model.named_parameters():
        if n in weights:
            torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
    assert (_logits(model, ids) - adapted).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_loads_with_peft(family, lora_model, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_dir, _, model, base_logits = lora_model(family)
    _train(model, steps=3)
    model.eval()
    ids = _ids()
    adapted = _logits(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-3

    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"])
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 2 * 7

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert (peft_logits - adapted).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_hf_export(family, lora_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    _, _, model, _ = lora_model(family, targets=("q", "v", "down"))
    _randomize_b(model)
    ids = _ids()
    adapted = _logits(model, ids)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    out = save_merged_hf(model, tmp_path / "merged")
    assert not any(m.merged for _, m in lora_modules(model))          # left as it was
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
    assert all(isinstance(m, LoRALinear) for _, m in lora_modules(model))

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - adapted).abs().max() <= 1e-4


def test_bad_configs_fail_with_names(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("qwen3")
    model = load_hf(hf_dir, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"\['q_proj'\].*\['down', 'gate', 'k', 'o', 'q'"):
        apply_lora(model, LoraConfig(targets=("q", "q_proj")))
    with pytest.raises(ConfigError, match=r"\['q_norm'\] exist but are not nn.Linear"):
        apply_lora(model, LoraConfig(targets=("q_norm",)))
    assert all(p.requires_grad for p in model.parameters())           # nothing was changed
    with pytest.raises(ConfigError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="string"):
        LoraConfig(targets="q")
    apply_lora(model, LoraConfig(targets=("attn.q",)))                 # dotted suffix works
    assert [n for n, _ in lora_modules(model)] == ["layers.0.attn.q", "layers.1.attn.q"]
    with pytest.raises(ConfigError, match="already"):
        apply_lora(model, LoraConfig())


def test_seeded_init_dropout_and_flops_kwargs(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("llama")
    a, b = (apply_lora(load_hf(hf_dir, dtype=torch.float32), LoraConfig(init_seed=3, dropout=0.5))
            for _ in range(2))
    sa, sb = lora_state_dict(a), lora_state_dict(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    bound = 1 / 64 ** 0.5
    q = dict(lora_modules(a))["layers.0.attn.q"]
    assert q.lora_A.abs().max() <= bound and q.lora_A.std() > bound / 3 and q.scaling == 2.0
    _randomize_b(a)
    ids = _ids()
    assert torch.equal(_logits(a.eval(), ids), _logits(a, ids))       # no dropout in eval
    assert not torch.equal(_logits(a.train(), ids), _logits(a.eval(), ids))
    assert flops_kwargs(LoraConfig(rank=8, targets=("q", "v"))) == {
        "lora_rank": 8, "lora_targets": ("q", "v")}
    assert flops_kwargs(None) == {}
