"""Logit verifier: the native model against transformers on the same weights.

`verify` builds the transformers reference (`AutoModelForCausalLM`, fp32, eager or sdpa
attention) and the native model from the same checkpoint, feeds both the same random tokens and
reports the largest absolute logit difference and the per-position KL(reference || native).
With `packed=True` it also runs a packed row (several documents, positions restarting at each)
through the native model and compares every document with its own transformers run.

    posttrain verify-model --hf-dir DIR [--seq-len 64 --batch 2 --packed --atol 1e-4]
    posttrain verify-model --family gemma3 --config '{"sliding_window": 4}'

prints a JSON report and exits 1 when a difference exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.errors import ConfigError
from posttrain.models.hf_io import load_hf
from posttrain.models.transformer import Transformer

_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=250, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    initializer_range=0.1,   # larger than HF's 0.02 so that attention patterns are not flat
)
_TINY: dict[str, dict[str, Any]] = {
    "qwen3": dict(num_hidden_layers=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # llama3 scaling with a short original context so that all three frequency bands occur
    "llama": dict(num_hidden_layers=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                   "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # window shorter than the test sequences, mixed layer types, local/global rope bases,
    # linear scaling on the global one, a query scalar that differs from head_dim, softcap
    "gemma3": dict(num_hidden_layers=4, tie_word_embeddings=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                "full_attention"],
                   query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                          "rope_theta": 1_000_000.0}}),
    # 8 experts, top-2; layers 0, 1, 3 MoE, layer 2 dense (mlp_only_layers)
    "qwen3_moe": dict(num_hidden_layers=4, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[2],
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # 4 experts, top-2, alternating sliding (window 6, shorter than the test rows) and full
    # layers, YaRN with GPT-OSS's parameters (its ramp spans dims 2-4 of 8 at head_dim 16)
    "gpt_oss": dict(num_hidden_layers=4, tie_word_embeddings=False, intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    max_position_embeddings=131_072,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0,
                                     "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False,
                                     "original_max_position_embeddings": 4096}),
    # three gated-DeltaNet layers and one full-attention layer (Qwen3.5's 3:1 pattern), value
    # heads shared two per key head, partial RoPE (a quarter of each head), output gates
    "qwen3_5": dict(num_hidden_layers=4, tie_word_embeddings=False,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                     "partial_rotary_factor": 0.25}),
    # the same with a routed MoE (8 experts, top-2) and a gated shared expert in every layer
    "qwen3_5_moe": dict(num_hidden_layers=4, tie_word_embeddings=False,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=8,
                        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                         "partial_rotary_factor": 0.25}),
    # multi-head latent attention with a query latent, value heads (12) narrower than query /
    # key heads (16 + 8), interleaved RoPE; one dense layer then three MoE layers of 8 experts
    # in 4 groups (top-2 of the best 2 groups, sigmoid scores, score-correction bias), two
    # shared experts, routed weights renormalised and scaled
    "deepseek_v3": dict(num_hidden_layers=4, tie_word_embeddings=False, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
                        first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # every Gemma 4 feature at once: sliding (window 6) and full layers with their own head
    # width and fewer key/value heads (8 query heads; 4 kv heads of 8 on sliding, 2 of 16 on
    # full layers), values from the key projection on full layers, proportional RoPE over a
    # quarter of the full heads, per-layer input embeddings, the last two layers (one of each
    # kind) reusing earlier layers' keys and values with double-wide MLPs, the MoE block beside
    # the dense MLP (4 experts of width 24, top-2), final soft-capping
    "gemma4": dict(num_hidden_layers=6, tie_word_embeddings=True, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=8, global_head_dim=16,
                   num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=6,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention", "sliding_attention", "full_attention"],
                   hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True,
                   num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                   final_logit_softcapping=30.0,
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                       "full_attention": {"rope_type": "proportional",
                                          "partial_rotary_factor": 0.25,
                                          "rope_theta": 1_000_000.0}}),
}
_NOT_CONFIG_KWARGS = ("model_type", "architectures", "transformers_version")
_NO_DENSE_MLP = ("qwen3_5_moe",)      # configs without intermediate_size


_CONFIG_CLASSES = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "gemma3": "Gemma3TextConfig",
                   "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig",
                   "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig",
                   "deepseek_v3": "DeepseekV3Config", "gemma4": "Gemma4TextConfig"}


def tiny_hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config (hidden 64, 2-4 layers, vocab 250) of `family`."""
    import transformers

    if family not in _CONFIG_CLASSES:
        raise ConfigError(f"no tiny config for family '{family}'; known: "
                          f"{sorted(_CONFIG_CLASSES)}")
    # only this family's config module: transformers imports each on first use, and some pull
    # in far more than a config (Gemma 4's took 0.9 s, a run's memory plan builds one config)
    config_class = getattr(transformers, _CONFIG_CLASSES[family])
    kwargs = {**_TINY_COMMON, **_TINY[family]}
    if family in _NO_DENSE_MLP:
        kwargs.pop("intermediate_size")
    kwargs.update({k: v for k, v in overrides.items() if k not in _NOT_CONFIG_KWARGS})
    if family == "deepseek_v3":
        # derived in MLA, whatever overrides written for another family say (a recipe's
        # `model.init.overrides` with only its family changed): head_dim is qk_rope_head_dim,
        # and every query head has its own keys and values
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if family == "gemma4":      # the per-layer input embeddings cover the vocabulary
        kwargs.setdefault("vocab_size_per_layer_input", kwargs["vocab_size"])
    return config_class(**kwargs)


def random_hf_model(config: Any, *, seed: int = 0,
                    attn_implementation: str = "eager") -> torch.nn.Module:
    """A transformers causal LM with random fp32 weights from `seed`.

    Norm weights are perturbed too: transformers initialises them to exactly 1 (0 with Gemma's
    1 + w), which would hide a wrong norm convention; so are biases and attention sinks (0 or
    tiny), which would hide a wrong bias layout, the scales initialised to 1 (Gemma 4's
    router scales and per-layer `layer_scalar` buffer), which would hide a missing one, and
    bias buffers (DeepSeek-V3's router score-correction bias, zero), which would hide how the
    router reads them.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "sinks")):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(0.2 * torch.randn(b.shape, generator=gen))
            elif name.endswith("bias") and b.is_floating_point():
                b.add_(0.5 * torch.randn(b.shape, generator=gen))
    return model.eval()


def _compare(ref_BTV: torch.Tensor, native_BTV: torch.Tensor) -> dict[str, float]:
    ref, nat = ref_BTV.double(), native_BTV.double()
    kl = (ref.softmax(-1) * (ref.log_softmax(-1) - nat.log_softmax(-1))).sum(-1)
    # KL(ref || native) per position; the per-position list is the max over the batch rows
    return {"max_abs_diff": float((ref - nat).abs().max()), "kl_max": float(kl.max()),
            "kl_mean": float(kl.mean()),
            "kl_per_position": [float(x) for x in kl.max(dim=0).values]}


def _random_documents(gen: torch.Generator, batch: int, seq_len: int) -> list[list[int]]:
    rows = []
    for _ in range(batch):
        n_docs = int(torch.randint(1, min(4, seq_len) + 1, (1,), generator=gen))
        cuts = torch.randperm(seq_len - 1, generator=gen)[: n_docs - 1] + 1
        edges = [0, *sorted(int(c) for c in cuts), seq_len]
        rows.append([b - a for a, b in zip(edges, edges[1:])])
    return rows


def _load_pair(source: str | Path | tuple[str, Any], seed: int, attn_implementation: str,
               workdir: Path) -> tuple[torch.nn.Module, Transformer, str]:
    from transformers import AutoModelForCausalLM, PreTrainedConfig

    if isinstance(source, tuple):
        family, config = source
        if not isinstance(config, PreTrainedConfig):
            config = tiny_hf_config(family, **(config or {}))
        ref = random_hf_model(config, seed=seed, attn_implementation=attn_implementation)
        ref.save_pretrained(workdir)
        hf_dir, label = workdir, f"{family} (random weights, seed {seed})"
    else:
        hf_dir, label = Path(source), str(source)
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                   attn_implementation=attn_implementation)
    return ref.eval(), load_hf(hf_dir, dtype=torch.float32).eval(), label


@torch.no_grad()
def verify(source: str | Path | tuple[str, Any], *, seq_len: int = 64, batch: int = 2,
           packed: bool = False, atol: float = 1e-4, seed: int = 0,
           attn_implementation: str = "eager", device: str = "cpu") -> dict[str, Any]:
    """Compare native and transformers logits (both fp32 on `device`); a JSON-ready report.

    `source` is an HF checkpoint directory, or `(family, config)` where config is a
    transformers config or a dict of HF config fields over `tiny_hf_config(family)`'s defaults
    (random weights from `seed`). `passed` is true when every max |logit difference| <= atol.
    """
    with tempfile.TemporaryDirectory(prefix="posttrain-verify-") as tmp:
        ref, native, label = _load_pair(source, seed, attn_implementation, Path(tmp))
    ref, native = ref.to(device), native.to(device)
    vocab = native.args.vocab_size
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)

    native_logits = native.logits(native(input_ids))
    report: dict[str, Any] = {
        "model": label, "family": native.args.family, "seq_len": seq_len, "batch": batch,
        "atol": atol, "attn_implementation": attn_implementation, "device": str(device),
        "vocab_size": vocab,
        "padded_vocab_size": native.args.padded_vocab_size,
        "padding_logits_neg_inf": bool(torch.isneginf(native_logits[..., vocab:]).all()),
        "unpacked": _compare(ref(input_ids).logits, native_logits[..., :vocab]),
    }
    checks = [report["unpacked"]]
    if packed:
        docs = _random_documents(gen, batch, seq_len)
        packed_logits = native.logits(native(input_ids, document_lengths=docs))[..., :vocab]
        ref_rows = []
        for b, lengths in enumerate(docs):
            pieces = input_ids[b].split(lengths)
            ref_rows.append(torch.cat([ref(p[None]).logits[0] for p in pieces]))
        report["packed"] = {**_compare(torch.stack(ref_rows), packed_logits),
                            "document_lengths": docs}
        checks.append(report["packed"])
    report["passed"] = (report["padding_logits_neg_inf"]
                        and all(c["max_abs_diff"] <= atol for c in checks))
    return report


def _parse_config(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        is_file = Path(text).is_file()
    except OSError:          # a long JSON string is not a valid path
        is_file = False
    try:
        return json.loads(Path(text).read_text() if is_file else text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config is neither a JSON file nor a JSON object: {exc}") from exc


def _fallback_note(hf_dir: str) -> str | None:
    """One line for a checkpoint without a native definition (nothing native to verify), else
    None."""
    from posttrain.models.auto import has_native_definition
    from posttrain.models.hf_io import read_hf_config
    config = read_hf_config(hf_dir)
    if has_native_definition(config):
        return None
    return (f"{hf_dir}: model_type '{config.get('model_type')}' has no native definition, so "
            "there is nothing to verify; it trains through the transformers fallback "
            "(posttrain.models.fallback), which covers SFT, DPO, GRPO, distillation and reward "
            "models, LoRA on its own Linear names and FSDP, without tensor parallelism, native "
            "document masks or a FLOPs formula")


def main(argv: Sequence[str] | None = None) -> int:
    """`posttrain verify-model`: print the report as JSON; 0 when it passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="posttrain verify-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hf-dir", help="Hugging Face checkpoint directory")
    where.add_argument("--family", choices=sorted(_TINY),
                       help="random tiny model of this family")
    parser.add_argument("--config", help="with --family: HF config fields (JSON or a file)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--packed", action="store_true",
                        help="also compare packed rows with per-document runs")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn-implementation", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--device", default="cpu", help="torch device for both models")
    ns = parser.parse_args(argv)
    if ns.config and not ns.family:
        parser.error("--config goes with --family")
    if ns.hf_dir and (line := _fallback_note(ns.hf_dir)):
        print(f"posttrain verify-model: {line}", file=sys.stderr)
        return 2
    source = ns.hf_dir if ns.hf_dir else (ns.family, _parse_config(ns.config))
    report = verify(source, seq_len=ns.seq_len, batch=ns.batch, packed=ns.packed,
                    atol=ns.atol, seed=ns.seed, attn_implementation=ns.attn_implementation,
                    device=ns.device)
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
