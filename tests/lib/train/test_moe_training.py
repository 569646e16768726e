"""MoE that trains: the router's load-balancing loss (and the optional z-loss) is part of the
training loss, through the engine, and reaches the router as transformers' does.

- With transformers' Qwen3-MoE (`output_router_logits=True`, the same `router_aux_loss_coef`)
  as the reference, one engine backward gives every router's gradient within 1e-5 (fp32),
  and the expert weights' too; `moe_aux_loss_coef: 0` gives the cross-entropy-only gradient.
- The z-loss term is mean_{layers, tokens} logsumexp(router logits)^2, padding left out.
- A step reports the router losses as metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.distributed.env import init_process_group
from posttrain.models.verify import random_hf_model, tiny_hf_config
from posttrain.train.engine import Engine, EngineConfig, ModelConfig
from posttrain.train.optim import OptimizerConfig

COEF = 0.05
VOCAB = 250


MOE_LAYERS = {"qwen3_moe": 3,        # layers 0, 1, 3 (layer 2 dense)
              "qwen3_5_moe": 4}      # every layer, beside a gated shared expert


def _hf_dir(tmp_path_factory, family: str) -> Path:
    out = tmp_path_factory.mktemp("moe") / family
    random_hf_model(tiny_hf_config(family, router_aux_loss_coef=COEF),
                    seed=0).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory, "qwen3_moe")


def _batch(seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A batch for the engine (labels shifted, some ignored) and transformers' (ids, labels)."""
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    hf_labels = ids.clone()
    hf_labels[:, :6] = -100                                # a prompt without loss
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = hf_labels[:, 1:]
    batch = {"input_ids": ids, "labels": labels,
             "position_ids": torch.arange(24).expand(2, 24), "document_lengths": None}
    return batch, ids, hf_labels


def _engine(hf_dir: Path, tmp: Path, **model) -> Engine:
    init_process_group()
    return Engine(ModelConfig(hf_dir=str(hf_dir), **model),
                  EngineConfig(max_steps=2, optimizer=OptimizerConfig(lr=1e-3),
                               grad_clip_norm=0.0), str(hf_dir), str(tmp))


def _grads(named: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
            for n, p in named.items() if p.grad is not None}


def _hf_grads(hf_dir: Path, aux: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 output_router_logits=aux).train()
    _, ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,aux", [("qwen3_moe", True), ("qwen3_moe", False),
                                        ("qwen3_5_moe", True)])
def test_router_gradients_equal_transformers(family, aux, hf_dir, tmp_path_factory, tmp_path):
    if family != "qwen3_moe":
        hf_dir = _hf_dir(tmp_path_factory, family)
    engine = _engine(hf_dir, tmp_path, **({} if aux else {"moe_aux_loss_coef": 0.0}))
    assert engine.router_coefs == ((COEF, 0.0) if aux else ())
    batch, _, hf_labels = _batch()
    units = int((batch["labels"] != -100).sum())
    engine.accumulate_gradients([batch], units)
    ours = _grads(dict(engine.model.named_parameters()))
    ref = _hf_grads(hf_dir, aux)
    routers = [n for n in ours if n.endswith("mlp.router.weight")]
    assert len(routers) == MOE_LAYERS[family]
    for name in routers:
        hf_name = "model." + name.replace("mlp.router", "mlp.gate")
        diff = (ours[name] - ref[hf_name]).abs().max().item()
        assert diff <= 1e-5, (name, diff)
    # the experts' gradients too (transformers fuses gate and up: [E, 2 I, H])
    i = int(routers[0].split(".")[1])
    gate_up = ref[f"model.layers.{i}.mlp.experts.gate_up_proj"]
    inter = ours[f"layers.{i}.mlp.experts.gate"].shape[1]
    assert (ours[f"layers.{i}.mlp.experts.gate"] - gate_up[:, :inter]).abs().max() <= 1e-5
    assert (ours[f"layers.{i}.mlp.experts.up"] - gate_up[:, inter:]).abs().max() <= 1e-5


def test_z_loss_and_the_step_metrics(hf_dir, tmp_path):
    from posttrain.models.moe import router_logits
    from posttrain.models.moe_balance import router_z_loss
    engine = _engine(hf_dir, tmp_path, moe_z_loss_coef=1e-3)
    assert engine.router_coefs == (COEF, 1e-3)
    batch, _, _ = _batch(seed=1)
    batch["row_num_pad"] = [0, 4]                          # the second row's last 4 are padding
    with torch.no_grad():
        engine.root.eval()
        engine.root(batch["input_ids"], batch["labels"], batch["position_ids"], None)
    logits = router_logits(engine.model)
    mask = torch.ones(2, 24)
    mask[1, 20:] = 0
    real = mask.reshape(-1).bool()
    expected = torch.cat([torch.logsumexp(lg.float(), -1)[real] ** 2 for lg in logits]).mean()
    assert router_z_loss(logits, mask).item() == pytest.approx(expected.item(), rel=1e-6)
    metrics = engine.train_step([batch], int((batch["labels"] != -100).sum()))
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/z_loss"] > 0
    # the load-balancing loss is near 1 for a balanced router (E * sum f P = 1 when uniform)
    assert 0.5 < metrics["moe/aux_loss"] < 4.0


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "deepseek_v3"
    random_hf_model(tiny_hf_config("deepseek_v3"), seed=0).save_pretrained(out)
    return out


def test_deepseek_v3_router_term_is_transformers_none(deepseek_dir, tmp_path):
    """transformers' DeepseekV3ForCausalLM adds no router loss (its loss is the cross-entropy,
    `output_router_logits` only returns the logits): by default neither does the engine, and
    the router and expert gradients equal transformers'."""
    engine = _engine(deepseek_dir, tmp_path)
    assert engine.router_coefs == () and engine.bias_update_speed == 0.0
    batch, _, _ = _batch()
    engine.accumulate_gradients([batch], int((batch["labels"] != -100).sum()))
    ours = _grads(dict(engine.model.named_parameters()))
    ref = _hf_grads(deepseek_dir, aux=True)
    for i in (1, 2, 3):
        assert (ours[f"layers.{i}.mlp.router.weight"]
                - ref[f"model.layers.{i}.mlp.gate.weight"]).abs().max() <= 1e-5
        gate_up, inter = ref[f"model.layers.{i}.mlp.experts.gate_up_proj"], 32
        assert (ours[f"layers.{i}.mlp.experts.gate"] - gate_up[:, :inter]).abs().max() <= 1e-5
        assert (ours[f"layers.{i}.attn.kv_b.weight"]
                - ref[f"model.layers.{i}.self_attn.kv_b_proj.weight"]).abs().max() <= 1e-5


def test_deepseek_v3_bias_balancing_moves_the_bias_by_the_plain_formula(deepseek_dir, tmp_path):
    """b_i += gamma * sign(mean load - load_i) per MoE layer after the step, loads counted over
    the step's real tokens; with the sequence-wise balance loss switched on as well."""
    from posttrain.errors import ConfigError
    speed = 1e-3
    engine = _engine(deepseek_dir, tmp_path, moe_bias_update_speed=speed,
                     moe_aux_loss_coef=1e-2)
    batch, _, _ = _batch(seed=2)
    batch["row_num_pad"] = [0, 5]
    blocks = [engine.model.layers[i].mlp for i in (1, 2, 3)]
    before = [b.e_score_correction_bias.clone() for b in blocks]
    with torch.no_grad():                   # the routing the step's forward will take
        engine.root.eval()
        engine.root(batch["input_ids"], batch["labels"], batch["position_ids"], None)
    real = torch.ones(2, 24, dtype=torch.bool)
    real[1, 19:] = False
    loads = [torch.zeros(8).index_add_(0, b.expert_NK[real.reshape(-1)].reshape(-1),
                                       torch.ones(int(real.sum()) * 2)) for b in blocks]
    metrics = engine.train_step([batch], int((batch["labels"] != -100).sum()))
    for block, b0, load in zip(blocks, before, loads):
        want = b0 + speed * torch.sign(load.mean() - load)
        assert torch.equal(block.e_score_correction_bias, want)
        assert block.e_score_correction_bias.dtype == torch.float32
    vio = sum(float(load.max() / load.mean() - 1) for load in loads) / 3
    assert metrics["moe/max_violation"] == pytest.approx(vio)
    assert metrics["moe/aux_loss"] > 0
    with pytest.raises(ConfigError, match="moe_bias_update_speed"):
        _engine(_hf_dir_qwen(tmp_path), tmp_path / "q", moe_bias_update_speed=speed)


def _hf_dir_qwen(tmp_path: Path) -> Path:
    out = tmp_path / "qwen3_moe"
    random_hf_model(tiny_hf_config("qwen3_moe"), seed=0).save_pretrained(out)
    return out


def test_deepseek_v3_router_is_not_rounded_in_a_bf16_run(deepseek_dir, tmp_path):
    """`model.dtype: bfloat16` rounds the weights it loads, except the router's weight and
    score-correction bias, which the model holds in fp32 as transformers does."""
    from posttrain.models import load_hf
    engine = _engine(deepseek_dir, tmp_path, dtype="bfloat16")
    ref = load_hf(deepseek_dir, dtype=torch.float32)
    for i in (1, 2, 3):
        ours, theirs = engine.model.layers[i], ref.layers[i]
        assert torch.equal(ours.mlp.e_score_correction_bias, theirs.mlp.e_score_correction_bias)
        assert torch.equal(ours.mlp.router.weight.full_tensor(), theirs.mlp.router.weight)
        assert torch.equal(ours.attn.kv_a.weight.full_tensor().float(),
                           theirs.attn.kv_a.weight.bfloat16().float())


def test_deepseek_v3_router_computes_in_fp32_under_bf16_mixed_precision(deepseek_dir,
                                                                         tmp_path):
    """FSDP's bf16 policy casts a block's weights for compute; the router (held in fp32, as
    transformers keeps it in bf16 models) gets an fp32 unit of its own, so it routes from fp32
    weights and inputs, while the experts compute in bf16."""
    from posttrain.distributed import ParallelConfig

    init_process_group()
    engine = Engine(ModelConfig(hf_dir=str(deepseek_dir)),
                    EngineConfig(max_steps=1, parallel=ParallelConfig(mixed_precision="bf16")),
                    str(deepseek_dir), str(tmp_path / "run"))
    seen = []
    for i in (1, 2, 3):
        mlp = engine.model.layers[i].mlp
        mlp.router.register_forward_hook(
            lambda m, args, out: seen.append(("router", args[0].dtype, m.weight.dtype)))
        mlp.experts.register_forward_hook(
            lambda m, args, out: seen.append(("experts", args[0].dtype, m.gate.dtype)))
    batch, _, _ = _batch()
    engine.train_step([batch], int((batch["labels"] != -100).sum()))
    assert seen == [("router", torch.float32, torch.float32),
                    ("experts", torch.bfloat16, torch.bfloat16)] * 3
