"""HF checkpoint load/save: names, shapes, dtypes, shards, meta loading, vocab resizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from posttrain.errors import ConfigError
from posttrain.models import load_hf, resize_vocab, save_hf

FAMILIES = ("qwen3", "llama", "gemma3", "qwen3_5", "qwen3_5_moe", "gemma4", "deepseek_v3")


def _ids(seq_len: int = 20, vocab: int = 250, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def _tiny_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(250)} | {"<unk>": 250}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_loads_in_transformers_with_same_logits(family, make_hf_dir, read_checkpoint,
                                                        tmp_path) -> None:
    hf_dir, ref = make_hf_dir(family)
    native = load_hf(hf_dir, dtype=torch.float32)
    assert torch.all(native.embed.weight[250:] == 0)          # zero padding rows
    tok_dir = tmp_path / "tok"
    _tiny_tokenizer(tok_dir)
    out = save_hf(native, tmp_path / "export", tokenizer_dir=tok_dir)

    original, exported = read_checkpoint(hf_dir), read_checkpoint(out)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 250 and config["model_type"] == ref.config.model_type
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w7") == 7

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, atol=0, rtol=0)
        native_logits = native.logits(native(ids))[..., :250]
        assert (native_logits - reloaded(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_bf16_checkpoint_keeps_its_dtype(family, make_hf_dir, read_checkpoint, tmp_path) -> None:
    hf_dir, ref = make_hf_dir(family)
    ref.to(torch.bfloat16).save_pretrained(hf_dir)
    native = load_hf(hf_dir)                                    # checkpoint dtype by default
    assert native.embed.weight.dtype == torch.bfloat16
    # bf16 numerics as transformers computes them (with its SDPA attention), bit for bit:
    # Gemma 4's norms multiply in fp32 before the cast, its experts sum in fp32
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert torch.equal(native.logits(native(_ids()))[..., :250], hf(_ids()).logits)
    out = save_hf(native, tmp_path / "export")
    original, exported = read_checkpoint(hf_dir), read_checkpoint(out)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t)
               for n, t in original.items())
    fp32 = save_hf(load_hf(hf_dir, dtype=torch.float32), tmp_path / "fp32", dtype=torch.float32)
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"


def test_deepseek_v3_bf16_keeps_the_router_in_fp32(make_hf_dir, read_checkpoint,
                                                   tmp_path) -> None:
    """transformers keeps DeepSeek-V3's router weight and score-correction bias in fp32 in a
    bf16 model (`_keep_in_fp32_modules_strict`); so does the native model (loaded, exported
    byte for byte, built in bf16), and tracks the bf16 transformers model."""
    from transformers import DeepseekV3ForCausalLM

    hf_dir, _ = make_hf_dir("deepseek_v3")
    ref = DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    ref.save_pretrained(hf_dir)
    original = read_checkpoint(hf_dir)
    fp32 = {n for n, t in original.items() if t.dtype == torch.float32}
    assert fp32 and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias")) for n in fp32)
    native = load_hf(hf_dir)
    assert native.embed.weight.dtype == torch.bfloat16
    assert native.layers[1].mlp.router.weight.dtype == torch.float32
    assert native.layers[1].mlp.e_score_correction_bias.dtype == torch.float32
    assert native.layers[1].mlp.e_score_correction_bias.abs().sum() > 0
    ids = _ids()
    with torch.no_grad():
        diff = (native.logits(native(ids))[..., :250].float() - ref(ids).logits.float())
    assert diff.abs().max() < 0.1
    exported = read_checkpoint(save_hf(native, tmp_path / "export"))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    from posttrain.models import build_model
    built = build_model(native.args, dtype=torch.bfloat16)
    assert built.layers[1].mlp.router.weight.dtype == torch.float32
    assert built.layers[0].attn.kv_a.weight.dtype == torch.bfloat16


def test_sharded_round_trip(make_hf_dir, read_checkpoint, tmp_path) -> None:
    hf_dir, ref = make_hf_dir("gemma3", save_kwargs={"max_shard_size": "60KB"})
    assert (hf_dir / "model.safetensors.index.json").is_file()     # HF-sharded input
    native = load_hf(hf_dir, dtype=torch.float32)
    out = save_hf(native, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in read_checkpoint(out).values())
    again = load_hf(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(native.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, atol=0, rtol=0)


def test_meta_load_materializes_only_selected(make_hf_dir) -> None:
    hf_dir, _ = make_hf_dir("llama", save_kwargs={"max_shard_size": "60KB"})
    full = load_hf(hf_dir, dtype=torch.float32)

    def owns(name: str) -> bool:
        return name.startswith("layers.1.") or name == "embed.weight"

    part = load_hf(hf_dir, dtype=torch.float32, on_meta=True, param_filter=owns)
    full_params = dict(full.named_parameters())
    for name, p in part.named_parameters():
        if owns(name):
            assert not p.is_meta and torch.equal(p, full_params[name]), name
        else:
            assert p.is_meta, name
    assert part.head.weight is part.embed.weight              # tied (Llama 3.2 style)
    with pytest.raises(ConfigError, match="on_meta=True"):
        load_hf(hf_dir, param_filter=owns)


@pytest.mark.parametrize("family", ["qwen3", "llama"])       # untied and tied heads
def test_resize_vocab_keeps_old_logits(family, make_hf_dir, tmp_path) -> None:
    hf_dir, _ = make_hf_dir(family)
    model = load_hf(hf_dir, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        before = model.logits(model(ids))
        old_mean = model.embed.weight[:250].mean(0)
        resize_vocab(model, 300)                             # 250 -> 300: padded 256 -> 320
        after = model.logits(model(ids))
    assert model.args.vocab_size == 300 and model.embed.weight.shape[0] == 320
    torch.testing.assert_close(after[..., :250], before[..., :250], atol=0, rtol=0)
    torch.testing.assert_close(model.embed.weight[250:300], old_mean.expand(50, -1))
    assert torch.all(model.embed.weight[300:] == 0) and torch.isneginf(after[..., 300:]).all()
    assert torch.isfinite(after[..., 250:300]).all()
    out = save_hf(model, tmp_path / "resized")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 300
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - after[..., :300]).abs().max() <= 1e-4
    with pytest.raises(ConfigError, match="shrink"):
        resize_vocab(model, 10)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_built_from_args_alone_exports(family, tmp_path) -> None:
    """A from-scratch model (no original config.json) still exports a loadable checkpoint."""
    from posttrain.models import args_from_hf_config, build_model
    from posttrain.models.families import bridge_for_family
    from posttrain.models.verify import tiny_hf_config

    args = args_from_hf_config(tiny_hf_config(family).to_dict()).replace(hf_config={})
    assert args_from_hf_config(bridge_for_family(family).config_from_args(args)) == args
    model = build_model(args, seed=0)
    out = save_hf(model, tmp_path / "scratch", dtype=torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - model.logits(model(ids))[..., :250]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_bf16_round_trip(family, make_hf_dir, read_checkpoint, tmp_path) -> None:
    """A bf16 Qwen3.5 checkpoint loads in bf16 (DeltaNet's fused tensors split) and saves back
    byte for byte; its bf16 logits are as close to the fp32 computation on the same weights as
    transformers' bf16 model's are. (Not bit-equal to them: the chunked delta rule and the
    convolution sum in other orders. On these random weights bf16 moves the logits by 0.4, and
    the MoE's by ~2 where rounding flips a routing choice, in both implementations.)"""
    hf_dir, ref = make_hf_dir(family)
    ref.to(torch.bfloat16).save_pretrained(hf_dir)
    native = load_hf(hf_dir)
    assert native.layers[0].attn.conv_q.dtype == torch.bfloat16
    out = save_hf(native, tmp_path / "export")
    original, exported = read_checkpoint(hf_dir), read_checkpoint(out)
    assert exported.keys() == original.keys()
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t)
               for n, t in original.items())
    def hf_logits(dtype: torch.dtype | None) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype,
                                                     attn_implementation="sdpa").eval()
        return model(_ids()).logits.float()

    with torch.no_grad():
        fp32, hf16 = hf_logits(torch.float32), hf_logits(None)
        ours = native.logits(native(_ids()))[..., :250].float()
    hf_error, our_error = (hf16 - fp32).abs().max(), (ours - fp32).abs().max()
    assert hf_error > 0 and our_error <= 1.5 * hf_error + 0.05, (our_error, hf_error)
