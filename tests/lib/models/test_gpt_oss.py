"""GPT-OSS: logits, gradients and aux loss against transformers' GptOssForCausalLM, YaRN, sharded
and partial loads of the fused expert layout, MXFP4 weights. (The bit-exact save round trip, a
model built from args alone, and grouped experts against the loop with biases and clamp:
tests/lib/models/test_moe.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

from posttrain.errors import ConfigError
from posttrain.models import load_hf, save_hf
from posttrain.models.hf_io import weight_map
from posttrain.models.layers import rope_attention_factor, rope_inv_freq
from posttrain.models.moe import router_logits
from posttrain.models.moe_balance import load_balancing_loss
from posttrain.models.mxfp4 import E2M1, dequantize
from posttrain.models.verify import tiny_hf_config, verify

# a clamp that bites (gate and up pre-activations are O(1) with these weights), two layers,
# a window of 3
CLAMPED = {"swiglu_limit": 1.0, "num_hidden_layers": 2, "sliding_window": 3,
           "layer_types": ["sliding_attention", "full_attention"]}


def _ids(seq_len: int = 24, vocab: int = 250) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("overrides", [{}, CLAMPED], ids=["yarn-sliding-sinks", "clamped"])
def test_verifier_passes_packed_and_unpacked(overrides) -> None:
    report = verify(("gpt_oss", overrides), seq_len=32, batch=2, packed=True, atol=1e-4)
    assert report["passed"], report
    assert report["unpacked"]["max_abs_diff"] <= 1e-4
    assert report["packed"]["max_abs_diff"] <= 1e-4
    assert any(len(row) > 1 for row in report["packed"]["document_lengths"])


@pytest.mark.parametrize("extra", [{"truncate": False}, {"truncate": True},
                                   {"mscale": 1.0, "mscale_all_dim": 0.5},
                                   {"attention_factor": 1.25}])
def test_yarn_matches_transformers(extra) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 4096, **extra}
    config = tiny_hf_config("gpt_oss", head_dim=64, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    assert torch.equal(rope_inv_freq(64, 150_000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == attention_factor


def test_args_and_module_tree(make_hf_dir) -> None:
    hf_dir, ref = make_hf_dir("gpt_oss")
    native = load_hf(hf_dir, dtype=torch.float32)
    args = native.args
    assert (args.attention_sinks, args.router_bias, args.expert_bias) == (True, True, True)
    assert args.moe_routing == "topk_softmax" and args.swiglu_limit == 7.0
    assert args.layer_types == ("sliding_attention", "full_attention") * 2
    assert args.rope_scaling["rope_type"] == "yarn" and list(native.rope) == ["full_attention",
                                                                             "sliding_attention"]
    assert native.rope["sliding_attention"] is native.rope["full_attention"]
    experts = native.layers[0].mlp.experts
    assert {n for n, _ in experts.named_parameters()} == {
        "gate", "up", "down", "gate_bias", "up_bias", "down_bias"}
    assert tuple(experts.gate.shape) == (4, 32, 64) and tuple(experts.down.shape) == (4, 64, 32)
    assert tuple(native.layers[0].attn.sinks.shape) == (4,)
    gate_up = ref.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts.up[1], gate_up[1, :, 1::2].T)
    assert torch.equal(experts.gate[3], gate_up[3, :, ::2].T)


def test_sharded_checkpoint_and_partial_load(make_hf_dir, tmp_path) -> None:
    hf_dir, _ = make_hf_dir("gpt_oss", **CLAMPED)
    native = load_hf(hf_dir, dtype=torch.float32)
    out = save_hf(native, tmp_path / "sharded", max_shard_bytes=40_000)
    assert len(set(weight_map(out).values())) > 2
    again = load_hf(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(native.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    meta = load_hf(out, on_meta=True, param_filter=lambda n: n.endswith("experts.up"))
    assert torch.equal(meta.layers[1].mlp.experts.up, native.layers[1].mlp.experts.up)
    assert meta.layers[1].mlp.experts.gate.is_meta and meta.layers[1].attn.sinks.is_meta


def test_aux_loss_and_gradients_match_transformers(make_hf_dir) -> None:
    hf_dir, ref = make_hf_dir("gpt_oss", **CLAMPED)
    native = load_hf(hf_dir, dtype=torch.float32)
    ids = _ids(20)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    out = ref(ids, output_router_logits=True)
    hidden = native(ids)
    logits = router_logits(native)
    for mine, theirs in zip(logits, out.router_logits, strict=True):
        assert (mine - theirs).abs().max() <= 1e-5
    assert abs(load_balancing_loss(logits, top_k=2).item() - out.aux_loss.item()) <= 1e-6
    masked_hf = load_balancing_loss_func(out.router_logits, 4, 2, mask)
    assert abs(load_balancing_loss(logits, 2, token_mask=mask).item() - masked_hf.item()) <= 1e-6
    coef = ref.config.router_aux_loss_coef
    assert abs(native.moe_aux_loss().item() - coef * out.aux_loss.item()) <= 1e-7

    w = torch.randn(2, 20, 250, generator=torch.Generator().manual_seed(3))
    ((out.logits * w).sum() + out.aux_loss).backward()
    ((native.logits(hidden)[..., :250] * w).sum() + load_balancing_loss(logits, 2)).backward()
    theirs, mine = ref.model.layers[1], native.layers[1]
    tol = dict(atol=1e-4, rtol=1e-4)
    gate_up, gate_up_bias = theirs.mlp.experts.gate_up_proj.grad, \
        theirs.mlp.experts.gate_up_proj_bias.grad
    torch.testing.assert_close(mine.mlp.experts.gate.grad, gate_up[..., ::2].transpose(1, 2), **tol)
    torch.testing.assert_close(mine.mlp.experts.up.grad, gate_up[..., 1::2].transpose(1, 2), **tol)
    torch.testing.assert_close(mine.mlp.experts.up_bias.grad, gate_up_bias[..., 1::2], **tol)
    torch.testing.assert_close(mine.mlp.experts.down.grad,
                               theirs.mlp.experts.down_proj.grad.transpose(1, 2), **tol)
    torch.testing.assert_close(mine.mlp.experts.down_bias.grad,
                               theirs.mlp.experts.down_proj_bias.grad, **tol)
    torch.testing.assert_close(mine.mlp.router.bias.grad, theirs.mlp.router.bias.grad, **tol)
    torch.testing.assert_close(mine.attn.sinks.grad, theirs.self_attn.sinks.grad, **tol)
    torch.testing.assert_close(mine.attn.q.bias.grad, theirs.self_attn.q_proj.bias.grad, **tol)


# ------------------------------------------------------------------------------------ MXFP4

def _pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., 32 * G] -> MXFP4 blocks [..., G, 16] (two codes a byte, low first)."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 16, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def test_mxfp4_dequantizes_known_values() -> None:
    codes = torch.tensor([list(range(16)) * 2, list(range(15, -1, -1)) * 2])   # [2, 32]
    scales = torch.tensor([[127], [130]], dtype=torch.uint8)                    # 2**0, 2**3
    want = torch.tensor([[E2M1[c] * 2.0 ** (int(s) - 127) for c in row]
                         for row, s in zip(codes.tolist(), scales[:, 0])])
    got = dequantize(_pack(codes), scales, torch.float32)
    assert got.shape == (2, 32) and torch.equal(got, want)
    assert want[1, 0] == -48.0 and want[0, 7] == 6.0

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 6, 2), dtype=torch.uint8, generator=g)
    torch.testing.assert_close(dequantize(blocks, scales).transpose(1, 2),
                               convert_moe_packed_tensors(blocks, scales), atol=0, rtol=0)


def test_mxfp4_checkpoint_loads_dequantized(make_hf_dir, read_checkpoint, tmp_path) -> None:
    """The experts stored as MXFP4 (as OpenAI's release stores them) load as the same weights as
    a bf16 checkpoint of the dequantized values; the export is unquantized."""
    hf_dir, ref = make_hf_dir("gpt_oss", **CLAMPED)
    g = torch.Generator().manual_seed(5)
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)                   # [E, in, out]
                e, cols, rows = param.shape
                codes = torch.randint(0, 16, (e, rows, cols), generator=g)
                scales = torch.randint(120, 126, (e, rows, cols // 32), dtype=torch.uint8,
                                       generator=g)
                blocks = _pack(codes)
                param.copy_(dequantize(blocks, scales, torch.float32).transpose(1, 2))
                key = f"model.layers.{i}.mlp.experts.{proj}"
                quantized[key + "_blocks"], quantized[key + "_scales"] = blocks, scales
    plain = tmp_path / "plain"
    ref.save_pretrained(plain)
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    replaced = {k.removesuffix("_blocks") for k in quantized if k.endswith("_blocks")}
    tensors = {k: v for k, v in read_checkpoint(plain).items() if k not in replaced}
    merged = {**tensors, **quantized}
    scales = [k for k in merged if k.endswith("_scales")]    # apart from their blocks
    shards = {"model-00001-of-00002.safetensors": [k for k in merged if k not in scales],
              "model-00002-of-00002.safetensors": scales}
    for file, names in shards.items():
        save_file({k: merged[k].contiguous() for k in names}, mx / file)
    (mx / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, names in shards.items() for k in names}}))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx / "config.json").write_text(json.dumps(config))

    want, got = load_hf(plain, dtype=torch.float32), load_hf(mx, dtype=torch.float32)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    out = save_hf(got, tmp_path / "export")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in weight_map(out)

    config["quantization_config"] = {"quant_method": "fp8"}
    (mx / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method 'fp8' is not supported"):
        load_hf(mx)
