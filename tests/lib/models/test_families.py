"""Native families against transformers (Qwen3, Llama 3.x, Gemma 3, Qwen3.5, Gemma 4; the
multimodal checkpoints of Qwen3.5, Gemma 3 and Gemma 4 through their text model), and the
module-name contract."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models import ModelArgs, args_from_hf_config, build_model, load_hf
from posttrain.models.transformer import FeedForward
from posttrain.models.verify import tiny_hf_config, verify

FAMILIES = ("qwen3", "llama", "gemma3", "gemma4")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_unpacked_and_packed(family: str) -> None:
    report = verify((family, {}), seq_len=32, batch=2, packed=True, atol=1e-4, seed=3)
    assert report["passed"], report
    assert report["unpacked"]["max_abs_diff"] <= 1e-4
    assert report["packed"]["max_abs_diff"] <= 1e-4
    assert report["unpacked"]["kl_max"] < 1e-9
    assert any(len(row) > 1 for row in report["packed"]["document_lengths"])


def test_gemma3_sliding_window_shorter_than_sequence_mixed_layers() -> None:
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    config = {"num_hidden_layers": 3, "layer_types": layer_types, "sliding_window": 5,
              "final_logit_softcapping": None}
    report = verify(("gemma3", config), seq_len=40, batch=2, packed=True, seed=1)
    assert report["passed"], report
    args = args_from_hf_config(tiny_hf_config("gemma3", **config).to_dict())
    assert args.sliding_window == 5 and args.layer_types == tuple(layer_types)
    assert args.rope_local_theta == 10_000.0 and args.rope_scaling["rope_type"] == "linear"


def test_qwen3_sliding_window_layers() -> None:
    config = {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
    report = verify(("qwen3", config), seq_len=24, batch=2, packed=True, seed=4)
    assert report["passed"], report


def test_sdpa_reference_also_matches() -> None:
    report = verify(("gemma3", {}), seq_len=24, batch=1, attn_implementation="sdpa")
    assert report["passed"], report


def test_legacy_config_spellings_read_like_v5() -> None:
    """v4 config.json files carry rope_theta / rope_scaling / rope_local_base_freq."""
    legacy_llama = {"model_type": "llama", "vocab_size": 250, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}}
    args = args_from_hf_config(legacy_llama)
    assert args.rope_theta == 500000.0 and args.head_dim == 16
    assert args.rope_scaling["rope_type"] == "llama3" and args.rope_scaling["factor"] == 8.0
    legacy_gemma = {"model_type": "gemma3_text", "vocab_size": 250, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "sliding_window": 512, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 16}
    g = args_from_hf_config(legacy_gemma)
    assert (g.rope_theta, g.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert g.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert g.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert g.norm_offset and g.sandwich_norm and g.embed_scale and g.qk_norm


def test_unsupported_configs_fail_with_a_message() -> None:
    with pytest.raises(ConfigError, match="model_type 'mistral'"):
        args_from_hf_config({"model_type": "mistral"})
    with pytest.raises(ConfigError, match="multimodal"):
        args_from_hf_config({"model_type": "gemma3", "text_config": {}})
    cfg = tiny_hf_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                    "rope_theta": 1e4}).to_dict()
    with pytest.raises(ConfigError, match="rope_type 'dynamic'"):
        build_model(args_from_hf_config(cfg))


def _native(family: str, **overrides) -> nn.Module:
    args = args_from_hf_config(tiny_hf_config(family, **overrides).to_dict())
    return build_model(args, seed=0)


def test_one_naming_scheme_across_families() -> None:
    common = {"embed.weight", "norm.weight"}
    layer = {"attn_norm.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight",
             "attn.o.weight", "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight",
             "mlp.down.weight"}
    expected = {
        "qwen3": layer | {"attn.q_norm.weight", "attn.k_norm.weight"},
        "llama": layer,
        "gemma3": layer | {"attn.q_norm.weight", "attn.k_norm.weight",
                           "post_attn_norm.weight", "post_mlp_norm.weight"},
    }
    for family, layer_names in expected.items():
        model = _native(family)
        names = set(model.state_dict())
        assert common <= names
        # a tied head reads the embedding and owns no parameter of its own
        assert ("head.weight" in names) == (not model.args.tie_word_embeddings), family
        assert model.head.weight.shape == model.embed.weight.shape
        assert {n.removeprefix("layers.0.") for n in names if n.startswith("layers.0.")} \
            == layer_names, family
        assert isinstance(model.layers[0].attn.q, nn.Linear)
        assert (model.head.weight is model.embed.weight) == model.args.tie_word_embeddings


def test_padded_vocab_rows_get_no_probability() -> None:
    for family in FAMILIES:
        model = _native(family)
        assert model.args.padded_vocab_size == 256 and model.args.vocab_size == 250
        assert torch.all(model.embed.weight[250:] == 0)
        logits = model.logits(model(torch.randint(0, 250, (2, 9))))
        assert logits.shape == (2, 9, 256)
        assert torch.isneginf(logits[..., 250:]).all() and torch.isfinite(logits[..., :250]).all()
        assert torch.all(logits.softmax(-1)[..., 250:] == 0)


def test_positions_restart_per_document_by_default() -> None:
    model = _native("qwen3")
    ids = torch.randint(0, 250, (1, 12))
    packed = model(ids, document_lengths=[[5, 7]])
    first, second = model(ids[:, :5]), model(ids[:, 5:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [16, 8])          # the whole head, and partial rotary
def test_rope_is_the_plain_expression_bitwise(dtype, rotary) -> None:
    """`apply_rope` writes its second product and the sum in place; values and gradients are
    those of `x * cos + rotate_half(x) * sin` bit for bit, and tables of another dtype take
    that expression itself."""
    from posttrain.models.layers import _rotate_half, apply_rope
    gen = torch.Generator().manual_seed(0)
    x0, grad = (torch.randn(2, 3, 5, 16, generator=gen).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(2, 5, rotary, generator=gen).to(dtype) for _ in range(2))

    def plain(x, cos, sin):
        c, s, r = cos.unsqueeze(1), sin.unsqueeze(1), rotary
        return torch.cat((x[..., :r] * c + _rotate_half(x[..., :r]) * s, x[..., r:]), dim=-1)

    for tables in ((cos, sin), (cos.double(), sin.double())):
        mine, ref = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        out, want = apply_rope(mine, *tables), plain(ref, *tables)
        out.backward(grad.to(out.dtype))
        want.backward(grad.to(want.dtype))
        assert out.dtype == want.dtype and torch.equal(out, want)
        assert torch.equal(mine.grad, ref.grad)


def test_mlp_factory_slot_and_custom_head() -> None:
    args = args_from_hf_config(tiny_hf_config("qwen3").to_dict())
    moe_args = args.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    built: list[int] = []

    class FakeMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(64, 4, bias=False)
            self.experts = FeedForward(args, intermediate_size=32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts(x)

    def factory(a: ModelArgs, i: int) -> nn.Module:
        built.append(i)
        return FakeMoE() if a.is_moe_layer(i) else FeedForward(a)

    model = build_model(moe_args, mlp_factory=factory, seed=0)
    assert built == [0, 1] and isinstance(model.layers[1].mlp, FakeMoE)
    assert "layers.0.mlp.router.weight" in model.state_dict()
    model.head = nn.Linear(64, 1, bias=False)     # e.g. a reward model's scalar head
    assert model.logits(model(torch.randint(0, 250, (2, 5)))).shape == (2, 5, 1)


def test_meta_build_has_no_storage() -> None:
    args = args_from_hf_config(tiny_hf_config("gemma3").to_dict())
    model = build_model(args, device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_load_hf_matches_direct_hf_forward(make_hf_dir) -> None:
    """Same weights, same positions: bf16 native forward tracks the fp32 reference."""
    hf_dir, ref = make_hf_dir("llama")
    native = load_hf(hf_dir, dtype=torch.bfloat16)
    assert native.embed.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 250, (1, 16))
    with torch.no_grad():
        diff = (native.logits(native(ids))[..., :250].float() - ref(ids).logits).abs().max()
    assert diff < 0.1


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_matches_transformers_over_several_chunks(family: str) -> None:
    """96 tokens: the delta rule's 64-token chunks, documents that cross a chunk boundary."""
    report = verify((family, {}), seq_len=96, batch=2, packed=True, seed=3)
    assert report["passed"], report
    assert report["packed"]["max_abs_diff"] <= 1e-4
    assert any(len(row) > 1 for row in report["packed"]["document_lengths"])
    args = args_from_hf_config(tiny_hf_config(family).to_dict())
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert args.rotary_dim == 4 and args.attn_output_gate and args.norm_offset


def _tiny_multimodal(family: str, out) -> str | tuple[str, ...]:
    """A tiny random multimodal checkpoint whose text model is `family`'s tiny config, saved
    as transformers saves it; returns the prefixes of its towers' keys."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma4Config,
                              Gemma4ForConditionalGeneration, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration)
    text = tiny_hf_config(family).to_dict()
    if family == "qwen3_5":
        config, cls, vision = Qwen3_5Config(text_config=text, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)), \
            Qwen3_5ForConditionalGeneration, "model.visual."
    elif family == "gemma4":        # vision and audio towers, each with its embedder
        config, cls, vision = Gemma4Config(
            text_config=text,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16),
            audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              output_proj_dims=64, subsampling_conv_channels=[8, 4])), \
            Gemma4ForConditionalGeneration, ("model.vision_tower.", "model.audio_tower.",
                                             "model.embed_vision.", "model.embed_audio.")
    else:
        config, cls, vision = Gemma3Config(text_config=text, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14)), Gemma3ForConditionalGeneration, "vision_tower."
    torch.manual_seed(0)
    model = cls(config).eval()
    if family == "gemma4":          # norms and scales at exactly 1 would hide a missing one
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("norm.weight", "layer_scalar", "router.scale", "expert_scale")):
                    t.add_(0.2 * torch.randn(t.shape))
    model.save_pretrained(out)
    return vision


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gemma4"])
def test_multimodal_checkpoint_trains_its_text_model(family, tmp_path, read_checkpoint) -> None:
    """A released-layout checkpoint (Qwen3_5ForConditionalGeneration; Gemma 3 4B-27B's
    Gemma3ForConditionalGeneration, `language_model.model.*`; Gemma4ForConditionalGeneration
    with every text feature on, its vision and audio towers): the native model is its text
    model, verified against transformers; the export keeps the towers byte for byte and
    loads as the same multimodal class with the native logits."""
    from transformers import AutoModelForCausalLM

    from posttrain.models import save_hf
    src, out = tmp_path / "mm", tmp_path / "export"
    vision = _tiny_multimodal(family, src)
    report = verify(src, seq_len=40, batch=2, packed=True, seed=1)
    assert report["passed"] and report["family"] == family, report
    native = load_hf(src)
    with torch.no_grad():                       # training moved a weight
        native.layers[0].attn.q.weight.add_(0.01)
    save_hf(native, out)
    before, after = read_checkpoint(src), read_checkpoint(out)
    assert set(before) == set(after)
    kept = [n for n in before if n.startswith(vision)]
    assert kept and all(torch.equal(before[n], after[n]) for n in kept)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) == 1 and moved[0].endswith(("in_proj_qkv.weight", "q_proj.weight"))
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        json.loads((src / "config.json").read_text())["architectures"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__.endswith("ForConditionalGeneration") or family == "qwen3_5"
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - native.logits(native(ids))[..., :250]).abs()
    assert diff.max() < 1e-4


DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0,
                 "original_max_position_embeddings": 64, "mscale": 0.707,
                 "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("variant", [
    {},    # the tiny config: query latent, interleaved RoPE, grouped routing, shared experts
    # a plain query projection, half-split RoPE, biased latent / output projections, routed
    # weights not renormalised
    {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True,
     "norm_topk_prob": False},
    # YaRN with DeepSeek's mscale: cos / sin scaled by mscale(f, 0.707) / mscale(f, 1) and the
    # softmax scale by mscale(f, 1)^2
    {"rope_parameters": DEEPSEEK_YARN},
], ids=["q_latent", "q_proj", "yarn"])
def test_deepseek_v3_matches_transformers(variant) -> None:
    report = verify(("deepseek_v3", variant), seq_len=40, batch=2, packed=True, seed=1)
    assert report["passed"], report
    assert any(len(row) > 1 for row in report["packed"]["document_lengths"])


def test_deepseek_v3_module_tree() -> None:
    from posttrain.models.mla import MultiHeadLatentAttention
    from posttrain.models.moe import MoEBlock
    model = _native("deepseek_v3")
    names = set(model.state_dict())
    attn = {"attn.q_a.weight", "attn.q_a_norm.weight", "attn.q_b.weight", "attn.kv_a.weight",
            "attn.kv_a_norm.weight", "attn.kv_b.weight", "attn.o.weight", "attn_norm.weight",
            "mlp_norm.weight"}
    dense = {"mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"}
    moe = {"mlp.router.weight", "mlp.e_score_correction_bias", "mlp.experts.gate",
           "mlp.experts.up", "mlp.experts.down", "mlp.shared.gate.weight",
           "mlp.shared.up.weight", "mlp.shared.down.weight"}
    for i, mlp in enumerate([dense, moe, moe, moe]):
        assert {n.removeprefix(f"layers.{i}.") for n in names
                if n.startswith(f"layers.{i}.")} == attn | mlp, i
    attn0, mlp1 = model.layers[0].attn, model.layers[1].mlp
    assert isinstance(attn0, MultiHeadLatentAttention) and isinstance(mlp1, MoEBlock)
    assert attn0.tp_colwise == ("q_b", "kv_b") and attn0.v_head_dim == 12
    assert mlp1.shared.gate.out_features == 64 and mlp1.shared_gate is None
    assert model.fp32_names() == {f"layers.{i}.mlp.{n}" for i in (1, 2, 3)
                                  for n in ("router.weight", "e_score_correction_bias")}
    plain_q = _native("deepseek_v3", q_lora_rank=None).layers[0].attn
    assert plain_q.q_a is None and plain_q.tp_colwise == ("q", "kv_b")
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        args_from_hf_config({**tiny_hf_config("deepseek_v3").to_dict(),
                                  "num_key_value_heads": 2})
    with pytest.raises(ConfigError, match="n_group"):
        _native("deepseek_v3", n_group=3)


def test_gemma4_without_moe_and_k_eq_v_and_with_three_shared_layers() -> None:
    """The E2B/E4B shape: full layers with the sliding layers' kv heads but their own head
    width, no MoE, no soft-capping; three KV-sharing layers, two of them sliding (reading layer
    1, window 6 shorter than the documents), one full (reading layer 2); transformers' SDPA
    attention as the reference."""
    config = {"attention_k_eq_v": False, "enable_moe_block": False, "num_kv_shared_layers": 3,
              "final_logit_softcapping": None}
    report = verify(("gemma4", config), seq_len=40, batch=2, packed=True, seed=1,
                    attn_implementation="sdpa")
    assert report["passed"], report
    args = args_from_hf_config(tiny_hf_config("gemma4", **config).to_dict())
    assert [args.kv_source(i) for i in range(6)] == [None, None, None, 1, 1, 2]
    assert args.attention_shape(2) == (4, 16) and args.attention_shape(0) == (4, 8)
    assert args.mlp_size(3) == 256 and args.mlp_size(2) == 128 and args.num_experts == 0


def test_gemma4_module_names() -> None:
    """A full-attention layer with experts and per-layer inputs (k_eq_v: no v), a KV-sharing
    layer (no k, v, k_norm), the model-level per-layer input embeddings; the scalar frozen."""
    model = _native("gemma4")
    names = set(model.state_dict())
    block = {"attn_norm.weight", "attn.q.weight", "attn.o.weight", "attn.q_norm.weight",
             "post_attn_norm.weight", "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight",
             "mlp.down.weight", "post_mlp_norm.weight", "post_dense_norm.weight",
             "moe_norm.weight", "moe.router.weight", "moe.router_scale", "moe.expert_scale",
             "moe.experts.gate", "moe.experts.up", "moe.experts.down", "post_moe_norm.weight",
             "per_layer_gate.weight", "per_layer_proj.weight", "post_per_layer_norm.weight",
             "layer_scalar"}
    for i, own in ((2, {"attn.k.weight", "attn.k_norm.weight"}), (5, set())):
        assert {n.removeprefix(f"layers.{i}.") for n in names
                if n.startswith(f"layers.{i}.")} == block | own, i
    assert {"per_layer_inputs.embed.weight", "per_layer_inputs.proj.weight",
            "per_layer_inputs.norm.weight"} <= names
    assert model.per_layer_inputs.embed.weight.shape == (250, 6 * 8)
    assert not model.layers[0].layer_scalar.requires_grad
    assert model.layers[0].attn.tp_colwise == ("q", "k", "v")
    assert model.layers[4].attn.tp_colwise == ("q",)


def test_gemma4_refusals_name_the_key() -> None:
    cfg = tiny_hf_config("gemma4").to_dict()
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        args_from_hf_config({**cfg, "use_bidirectional_attention": "all"})
    with pytest.raises(ConfigError, match="num_kv_shared_layers"):
        args_from_hf_config({**cfg, "num_kv_shared_layers": 6})
    args = args_from_hf_config(cfg)
    with pytest.raises(ConfigError, match="vocab_size_per_layer_input"):
        build_model(args.replace(vocab_size=260), device="meta")
