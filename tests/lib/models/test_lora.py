"""LoRA: init equals base, merge/unmerge, frozen base, disable_adapters, PEFT and merged export;
the same for the stacked adapters on MoE expert weights (`LoRAExperts`), plus both expert
dispatch paths, PEFT's target_parameters layout, the refusals and the weight-sync fold."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from posttrain.errors import ConfigError
from posttrain.models import load_hf
from posttrain.models.lora import (LoRAExperts, LoraConfig, apply_lora, disable_adapters,
                                   flops_kwargs, fold_adapters, lora_modules, lora_state_dict,
                                   merge_lora, unmerge_lora)
from posttrain.models.lora_export import check_peft_export, save_merged_hf, save_peft_adapter
from posttrain.models.moe import Experts, grouped_mm_available

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
        for name, p in lora_state_dict(model).items():
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids = _ids(seed=5)
    logits = model.logits(model(ids[:, :-1]))[..., :VOCAB]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _train(model: torch.nn.Module, steps: int = 3) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(steps):
        loss = _loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _check_only_adapters_train(model: torch.nn.Module, base_logits: torch.Tensor) -> None:
    """Two optimizer steps: every adapter gets a gradient, nothing else does, the logits move."""
    _train(model, steps=2)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert not torch.allclose(_logits(model, _ids()), base_logits, atol=1e-4)


def _check_merge_unmerge_disable(model: torch.nn.Module, base_logits: torch.Tensor) -> None:
    """With random B: disabled adapters give the base (merged or not), merging keeps the
    logits and changes the base weights, unmerging restores them."""
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
    assert any(not torch.equal(p, weights[n]) for n, p in model.named_parameters()
               if n in weights)                                       # folded into the base
    assert (_logits(model, ids) - adapted).abs().max() <= 1e-5
    with disable_adapters(model):                                      # also while merged
        assert (_logits(model, ids) - base_logits).abs().max() <= 1e-5
    unmerge_lora(model)
    assert not any(m.merged for _, m in lora_modules(model))
    for n, p in model.named_parameters():
        if n in weights:
            torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
    assert (_logits(model, ids) - adapted).abs().max() <= 1e-5


def _hf_logits(hf_dir, ids: torch.Tensor, adapter=None) -> torch.Tensor:
    """Logits of the transformers model in `hf_dir` (fp32, eager), with PEFT `adapter` on it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.fixture
def lora_model(make_hf_dir):
    def make(family: str, rank: int = 4, **cfg):
        hf_dir, ref = make_hf_dir(family)
        model = load_hf(hf_dir, dtype=torch.float32).eval()
        base_logits = _logits(model, _ids())
        apply_lora(model, LoraConfig(rank=rank, alpha=8.0, init_seed=0, **cfg))
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
    _check_only_adapters_train(model, base_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_unmerge_and_disable(family, lora_model) -> None:
    _, _, model, base_logits = lora_model(family)
    _check_merge_unmerge_disable(model, base_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_loads_with_peft(family, lora_model, tmp_path) -> None:
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

    assert (_hf_logits(hf_dir, ids, adapter=out) - adapted).abs().max() <= 1e-4


@pytest.mark.parametrize("family,targets", [
    ("qwen3", ("q", "v", "down")), ("llama", ("q", "v", "down")),
    ("qwen3_moe", ("v", "experts.gate", "experts.up", "experts.down"))])
def test_merged_hf_export(family, targets, lora_model, tmp_path) -> None:
    _, _, model, _ = lora_model(family, targets=targets)
    _randomize_b(model)
    ids = _ids()
    adapted = _logits(model, ids)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrappers = {n: type(m) for n, m in lora_modules(model)}

    out = save_merged_hf(model, tmp_path / "merged")
    assert not any(m.merged for _, m in lora_modules(model))          # left as it was
    assert {n: type(m) for n, m in lora_modules(model)} == wrappers
    assert set(dict(model.named_parameters())) == set(weights)         # adapters back
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, weights[n], atol=1e-6, rtol=0)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert not any("lora" in k for k in f.keys())

    assert (_hf_logits(out, ids) - adapted).abs().max() <= 1e-5


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


# ------------------------------------------------------------- MoE experts (stacked adapters)

EXPERTS = ("experts.gate", "experts.up", "experts.down")
MOE_LAYERS = (0, 1, 3)          # the tiny Qwen3-MoE: layer 2 is dense (mlp_only_layers)


def test_experts_init_equals_base_and_only_adapters_train(lora_model) -> None:
    _, _, model, base_logits = lora_model("qwen3_moe", targets=("q", *EXPERTS))
    assert torch.equal(_logits(model, _ids()), base_logits)              # B = 0 at init
    experts = {n: m for n, m in lora_modules(model) if isinstance(m, LoRAExperts)}
    assert sorted(experts) == [f"layers.{i}.mlp.experts" for i in MOE_LAYERS]
    params = dict(model.named_parameters())
    assert tuple(params["layers.1.mlp.experts.gate_lora_A"].shape) == (8, 4, 64)    # [E, r, H]
    assert tuple(params["layers.1.mlp.experts.gate_lora_B"].shape) == (8, 32, 4)    # [E, I, r]
    assert tuple(params["layers.1.mlp.experts.down_lora_A"].shape) == (8, 4, 32)
    assert tuple(params["layers.1.mlp.experts.down_lora_B"].shape) == (8, 64, 4)
    assert params["layers.1.mlp.experts.gate"] is experts["layers.1.mlp.experts"].gate
    assert "layers.2.mlp.gate.lora_A" not in params          # `experts.gate` is not `gate`
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert len(trainable) == 2 * 4 + 3 * 3 * 2               # q in 4 layers, 3 per MoE layer
    _check_only_adapters_train(model, base_logits)


@pytest.mark.parametrize("rank", [4, 2], ids=["aligned", "unaligned_rank"])
def test_experts_grouped_and_loop_agree_with_gradients(rank, lora_model, monkeypatch) -> None:
    """Both dispatch paths run the adapters; rank 2 (8-byte rows, which torch._grouped_mm
    refuses) takes the loop for the adapter inside the grouped path."""
    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    _, _, model, _ = lora_model("qwen3_moe", rank=rank, targets=EXPERTS)
    _randomize_b(model)
    results = {}
    for impl in ("loop", "grouped"):
        monkeypatch.setattr(Experts, "impl", impl)
        model.zero_grad()
        loss = _loss(model)
        loss.backward()
        results[impl] = loss.detach(), {n: p.grad.clone() for n, p in
                                        model.named_parameters() if p.requires_grad}
    (loop_loss, loop_grads), (grouped_loss, grouped_grads) = results["loop"], results["grouped"]
    assert (loop_loss - grouped_loss).abs() <= 1e-5
    assert set(loop_grads) == set(grouped_grads) and len(loop_grads) == 3 * 3 * 2
    for name, g in loop_grads.items():
        assert g.abs().sum() > 0, name
        assert (g - grouped_grads[name]).abs().max() <= 1e-5, name


def test_experts_merge_unmerge_disable_and_fold(lora_model) -> None:
    _, _, model, base_logits = lora_model("qwen3_moe", targets=EXPERTS)
    _check_merge_unmerge_disable(model, base_logits)
    # the full-weight fold of GRPO's rollout weight sync gives the merged weights
    folded = fold_adapters({n: p.detach() for n, p in model.state_dict().items()}, 8.0 / 4)
    assert not any("lora" in n for n in folded)
    merge_lora(model)
    for n, t in folded.items():
        torch.testing.assert_close(t, model.state_dict()[n], atol=1e-6, rtol=0)


@pytest.mark.parametrize("targets", [("q", *EXPERTS), ("experts.up", "o")],
                         ids=["gate_up_down", "up_only"])
def test_experts_peft_export_reproduces_the_logits(targets, lora_model, tmp_path) -> None:
    """PEFT's target_parameters on transformers' fused experts: gate and up share
    gate_up_proj as one block-diagonal adapter of rank 2r (rank_pattern, alpha_pattern)."""
    hf_dir, _, model, base_logits = lora_model("qwen3_moe", targets=targets)
    _randomize_b(model)
    ids = _ids()
    adapted = _logits(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-2

    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    fused = "experts.gate" in targets
    assert set(config["target_parameters"]) == (
        {f"model.layers.{i}.mlp.experts.{p}" for i in MOE_LAYERS
         for p in (("gate_up_proj", "down_proj") if fused else ("gate_up_proj",))})
    assert config["rank_pattern"] == ({f"model.layers.{i}.mlp.experts.gate_up_proj": 8
                                       for i in MOE_LAYERS} if fused else {})
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    prefix = "base_model.model.model.layers.1.mlp.experts."
    if fused:      # gate_up_proj wrapped first (inner), down_proj around it
        assert shapes[prefix + "base_layer.lora_A.weight"] == (8 * 8, 64)
        assert shapes[prefix + "base_layer.lora_B.weight"] == (2 * 32, 8 * 8)
        assert shapes[prefix + "lora_A.weight"] == (8 * 4, 32)
        assert shapes[prefix + "lora_B.weight"] == (64, 8 * 4)
    else:
        assert shapes[prefix + "lora_B.weight"] == (2 * 32, 8 * 4)

    assert (_hf_logits(hf_dir, ids, adapter=out) - adapted).abs().max() <= 1e-5


def test_experts_recipe_export_from_a_state_dict(lora_model, tmp_path) -> None:
    """The recipes' export path (`export_hf`: rebuild on meta, adapters applied, the gathered
    state assigned) writes both formats for expert adapters."""
    from posttrain.train.engine import LoraSettings
    from posttrain.train.export import export_hf

    targets = ("k", "experts.up", "experts.down")
    hf_dir, _, model, _ = lora_model("qwen3_moe", targets=targets)
    _randomize_b(model)
    ids = _ids()
    adapted = _logits(model, ids)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    lora = LoraSettings(rank=4, alpha=8.0, targets=targets)
    merged = export_hf(state, model.args, str(tmp_path / "merged"), fmt="merged", lora=lora)
    adapter = export_hf(state, model.args, str(tmp_path / "peft"), fmt="peft", lora=lora,
                        base_dir=str(hf_dir))
    assert (_hf_logits(merged, ids) - adapted).abs().max() <= 1e-5
    assert (_hf_logits(hf_dir, ids, adapter=adapter) - adapted).abs().max() <= 1e-5


def test_experts_refusals_name_the_fix(make_hf_dir, tmp_path) -> None:
    from posttrain.train.engine import LoraSettings
    from posttrain.train.recipe import ExportConfig, check_export

    hf_dir, _ = make_hf_dir("qwen3_moe", mlp_only_layers=[])            # no dense MLP at all
    model = load_hf(hf_dir, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"\['gate'\] name no dense MLP.*'experts.gate'"):
        apply_lora(model, LoraConfig(targets=("q", "gate")))
    assert all(p.requires_grad for p in model.parameters())             # nothing changed

    apply_lora(model, LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=("experts.down",)))
    with pytest.raises(ConfigError, match=r"dropout.*export.format: merged"):
        save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    assert not (tmp_path / "adapter").exists()

    # and at config time, before any step runs
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.1, targets=("q", "mlp.experts.up"))
    with pytest.raises(ValueError, match=r"\['mlp.experts.up'\].*lora.dropout: 0"):
        check_export(ExportConfig(format="peft"), lora)
    check_export(ExportConfig(format="merged"), lora)
    check_peft_export(("q", "mlp.experts.gate"), 0.0)
    check_peft_export(("q", "gate"), 0.05)                              # dense: PEFT has it

    dense_dir, _ = make_hf_dir("qwen3", name="dense")
    with pytest.raises(ConfigError, match=r"\['experts.gate'\] match no nn.Linear"):
        apply_lora(load_hf(dense_dir, dtype=torch.float32),
                   LoraConfig(targets=("experts.gate",)))


@pytest.mark.parametrize("family,targets", [
    ("qwen3_5", ("q", "k", "v", "z", "o", "gate")),       # DeltaNet's q/k/v share in_proj_qkv
    ("qwen3_5_moe", ("k", "o", "experts.down")),           # one of the three fused parts
])
def test_qwen3_5_adapters_train_and_export(family, targets, lora_model, tmp_path) -> None:
    """Adapters on the gated-DeltaNet and gated-attention projections (and experts): only they
    train; the merged export and (for the plain projections) the PEFT adapter reproduce the
    adapted logits in transformers. PEFT adapts the fused `in_proj_qkv` with one adapter whose
    B places each part's block in its rows."""
    hf_dir, _, model, base_logits = lora_model(family, targets=targets)
    _check_only_adapters_train(model, base_logits)
    model.eval()
    ids = _ids()
    adapted = _logits(model, ids)
    # 1e-4, the verifier's bound: native and transformers' delta rules differ by ~1e-5 in fp32
    assert (_hf_logits(save_merged_hf(model, tmp_path / "merged"), ids) - adapted).abs().max() \
        <= 1e-4
    if family == "qwen3_5":
        out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["rank_pattern"]["model.layers.0.linear_attn.in_proj_qkv"] == 3 * 4
        assert "in_proj_qkv" in config["target_modules"] and "q_proj" in config["target_modules"]
        assert (_hf_logits(hf_dir, ids, adapter=out) - adapted).abs().max() <= 1e-4


def test_gemma4_adapters_train_and_export(lora_model, tmp_path) -> None:
    """Gemma 4 (every feature on): adapters on the attention projections of every layer kind
    (KV-sharing layers have q and o only, k_eq_v layers no v), the dense MLP, the per-layer
    input gate and projection, the router and the experts beside the MLP; only they train, and
    the merged export and the PEFT adapter (experts as fused target_parameters) reproduce the
    adapted logits in transformers."""
    targets = ("q", "k", "v", "o", "gate", "up", "down", "per_layer_gate", "per_layer_proj",
               "router", "experts.gate", "experts.up", "experts.down")
    hf_dir, _, model, base_logits = lora_model("gemma4", targets=targets)
    assert {type(model.get_submodule(n)).__name__ for n in
            ("layers.2.attn.k", "layers.4.attn.q", "layers.0.moe.router")} == {"LoRALinear"}
    assert model.layers[2].attn.v is None and model.layers[4].attn.k is None
    _check_only_adapters_train(model, base_logits)
    model.eval()
    ids = _ids()
    adapted = _logits(model, ids)
    assert (_hf_logits(save_merged_hf(model, tmp_path / "merged"), ids) - adapted).abs().max() \
        <= 1e-4
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"proj", "per_layer_input_gate", "q_proj"} <= set(config["target_modules"])
    assert "model.layers.5.experts.gate_up_proj" in config["target_parameters"]
    assert (_hf_logits(hf_dir, ids, adapter=out) - adapted).abs().max() <= 1e-4


def test_deepseek_v3_adapters_train_and_export(lora_model, tmp_path) -> None:
    """Adapters on MLA's latent and head projections, the output, the routed experts and the
    shared experts: only they train; the merged export and the PEFT adapter (experts as PEFT
    `target_parameters` on transformers' fused DeepSeek-V3 experts) reproduce the adapted
    logits in transformers."""
    targets = ("q_a", "q_b", "kv_a", "kv_b", "o", "shared.up", "experts.gate", "experts.down")
    hf_dir, _, model, base_logits = lora_model("deepseek_v3", targets=targets)
    wrapped = {n.removeprefix("layers.1.") for n, _ in lora_modules(model)
               if n.startswith("layers.1.")}
    assert wrapped == {"attn.q_a", "attn.q_b", "attn.kv_a", "attn.kv_b", "attn.o",
                       "mlp.shared.up", "mlp.experts"}
    _check_only_adapters_train(model, base_logits)
    model.eval()
    ids = _ids()
    adapted = _logits(model, ids)
    assert (_hf_logits(save_merged_hf(model, tmp_path / "merged"), ids) - adapted).abs().max() \
        <= 1e-5
    # PEFT reads a target module named up_proj as the experts' too (transformers fuses those
    # into gate_up_proj) and refuses it without gate_proj: the adapter leaves the shared
    # experts out
    hf_dir, _, model, _ = lora_model("deepseek_v3", targets=targets[:5] + targets[6:])
    _randomize_b(model)
    adapted = _logits(model, ids)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} == set(
        config["target_modules"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in config["target_parameters"]
    assert (_hf_logits(hf_dir, ids, adapter=out) - adapted).abs().max() <= 1e-5


@pytest.mark.parametrize("family,targets", [("qwen3_moe", ("q", "gate", "up", "down")),
                                            ("deepseek_v3", ("shared.gate", "shared.up",
                                                             "shared.down"))])
def test_dense_mlp_adapters_of_moe_models_are_refused_as_peft(family, targets, lora_model,
                                                              tmp_path) -> None:
    """PEFT re-targets gate_proj / up_proj / down_proj of an MoE model to its fused experts, so
    an adapter on the dense layers (Qwen3-MoE's mlp_only_layers) or DeepSeek-V3's shared experts
    would load onto the experts (logits 0.5-1.9 off): refused, with the merged export named."""
    _, _, model, _ = lora_model(family, targets=targets)
    with pytest.raises(ConfigError, match="merged"):
        save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="x")
