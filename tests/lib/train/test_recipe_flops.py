"""Each recipe's counted step FLOPs (what its MFU divides by) against torch's FlopCounterMode.

One real training step of every recipe, through its `RecipeWorker` on the tiny model, runs
under `FlopCounterMode`; the recipe's `flops(batch)` must match what was executed within 1%:
the policy's forward and backward over packed documents, LoRA's adapters (also stacked on MoE
experts), DPO's and KTO's in-step reference (lora_base) and none for the reference-free SimPO,
the online teacher's forward in distillation,
the LM head over the labelled positions only, the sequence recipe's per-position heads over
theirs.

Two differences between executed and model FLOPs are taken out of the count, both measured,
not assumed (as in tests/lib/models/test_flops.py):

- SDPA on the CPU counts its full score square per document (torch's GPU formula registered
  for the CPU kernel) and a 5-matmul backward; model FLOPs count the causal pairs and a
  4-matmul backward. The SDPA part is scaled by (causal pairs / square) and the backward by 4/5.
- The chunked log-prob ops recompute each chunk's logits in backward (`posttrain.ops.
  cross_entropy.chunked_logprobs`, `posttrain.losses.distill`): one more forward of each head
  in the loss (the teacher's too in distillation). That is hardware work, not model work; it
  is taken out. The cross-entropy of SFT and the sequence recipe, and GRPO's token-ratio loss
  (`chunked_logprob_objective`), form their gradients in the forward pass and recompute
  nothing, so there executed and counted FLOPs must agree as they are.
- FlopCounterMode has no formula for in-place `addmm_` (the chunked ops accumulate the head's
  weight gradient with it); torch's `addmm` formula is registered for it.

A batch's padding is cut off first: the kernels run over pad tokens, but MFU counts real
tokens only (padding is waste, not model work).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

ROOT = Path(__file__).resolve().parents[3]
aten = torch.ops.aten
SDPA_FWD = aten._scaled_dot_product_flash_attention_for_cpu
SDPA_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward
RTOL = 0.01

_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "tie_word_embeddings": False}
_MOE = {**_MODEL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_TEACHER = {**_MODEL, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3}
_TRAIN = {"max_steps": 2, "tokens_per_step": 256, "optimizer": {"lr": 1e-3},
          "parallel": {"activation_checkpointing": "none"}, "checkpoint_every_steps": 100}


def _sdpa_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _config(kind: str, **extra) -> dict:
    common = {"run": {"launcher": "inline"},
              "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
              "model": {"init": {"family": "qwen3", "seed": 0, "overrides": _MODEL},
                        "loss_chunk_tokens": 32}}
    data = ROOT / "assets" / "data"
    if kind == "events":
        return {"run": {"launcher": "inline"}, **extra,
                "vocab": {"num_items": 100},
                "heads": {"per_position": {
                    "event_type": {"kind": "classification", "num_classes": 4, "weight": 0.5},
                    "dwell": {"kind": "regression", "target": "current"}}},
                "model": common["model"],
                "data": {"format": "sequence",
                         "train": [{"name": "ev", "path": str(data / "events/train.jsonl")}]},
                "train": {**_TRAIN, "loader": {"packing": {"max_tokens_per_pack": 256}}}}
    if kind == "chat":
        return {**common, **extra,
                "data": {"format": "chat", "max_tokens_per_sample": 128,
                         "train": [{"name": "chat", "path": str(data / "chat/train.jsonl")}]},
                "train": {**_TRAIN, "loader": {"packing": {"max_tokens_per_pack": 256}}}}
    return {**common, **extra,       # preference pairs, or KTO's unpaired completions
            "data": {"format": kind, "max_tokens_per_sample": 64, "on_bad_row": "skip",
                     "train": [{"name": "pref", "path": str(data / kind / "train.jsonl")}]},
            "train": {**_TRAIN, "loader": {"format": kind,
                                           "packing": {"max_tokens_per_pack": 256}}}}


CASES = {
    "sft": ("sft", "chat", {}),
    "sft_lora": ("sft", "chat", {"model": {"init": {"family": "qwen3", "seed": 0,
                                                    "overrides": _MODEL},
                                           "loss_chunk_tokens": 32,
                                           "lora": {"rank": 4, "alpha": 8.0,
                                                    "targets": ["q", "v", "down"]}},
                                 "export": {"format": "peft"}}),
    "sft_moe_lora": ("sft", "chat", {"model": {"init": {"family": "qwen3_moe", "seed": 0,
                                                        "overrides": _MOE},
                                               "loss_chunk_tokens": 32,
                                               "lora": {"rank": 4, "alpha": 8.0, "targets": [
                                                   "o", "experts.gate", "experts.down"]}},
                                     "export": {"format": "peft"}}),
    "dpo": ("dpo", "preference", {}),
    "dpo_lora_base": ("dpo", "preference", {
        "model": {"init": {"family": "qwen3", "seed": 0, "overrides": _MODEL},
                  "loss_chunk_tokens": 32, "lora": {"rank": 4, "alpha": 8.0}},
        "reference": {"kind": "lora_base"}, "export": {"format": "peft"}}),
    "simpo": ("dpo", "preference", {"loss": {"loss_type": "simpo", "beta": 2.0}}),
    "kto_lora_base": ("dpo", "unpaired", {
        "model": {"init": {"family": "qwen3", "seed": 0, "overrides": _MODEL},
                  "loss_chunk_tokens": 32, "lora": {"rank": 4, "alpha": 8.0}},
        "loss": {"loss_type": "kto"}, "reference": {"kind": "lora_base"},
        "export": {"format": "peft"}}),
    "reward": ("reward", "preference", {}),
    "distill": ("distill", "chat", {"teacher": {"init": {"family": "qwen3", "seed": 1,
                                                         "overrides": _TEACHER}}}),
    "sequence": ("sequence", "events", {}),
}


def _recipe(name: str) -> type:
    from posttrain.train.distill import Distill
    from posttrain.train.dpo import DPO
    from posttrain.train.reward import Reward
    from posttrain.train.sequence import Sequence
    from posttrain.train.sft import SFT
    return {"sft": SFT, "dpo": DPO, "reward": Reward, "distill": Distill,
            "sequence": Sequence}[name]


def _unpadded(batch: dict) -> dict:
    """The batch without its trailing padding (one row per batch here)."""
    assert batch["input_ids"].shape[0] == 1
    pad = int(batch["row_num_pad"][0])
    if not pad:
        return batch
    keep = batch["input_ids"].shape[1] - pad
    out = dict(batch)
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == keep + pad:
            out[k] = v[:, :keep]
    out["document_lengths"] = [list(batch["document_lengths"][0][:-1])]
    out["row_num_pad"], out["num_pad_tokens"] = [0], 0
    out["num_real_tokens"] = keep
    return out


def _addmm_(input_shape, mat1_shape, mat2_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * mat1_shape[0] * mat1_shape[1] * mat2_shape[1]


def _causal_fraction(docs: list[int]) -> float:
    return sum(n * (n + 1) // 2 for n in docs) / sum(n * n for n in docs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipe_flops")


@pytest.mark.parametrize("case", list(CASES))
def test_counted_step_flops_match_the_flop_counter(case, workdir):
    from posttrain.config.loader import build, to_dict
    from posttrain.models.moe import grouped_mm_available, grouped_mm_flops
    from posttrain.train.recipe import RecipeWorker
    from steps.common import base_model_dir, ensure_prepared
    from steps.train_distill import teacher

    name, kind, extra = CASES[case]
    recipe = _recipe(name)
    cfg = build(recipe.config_cls, {**_config(kind, **extra), "run": {
        "launcher": "inline", "dir": str(workdir / case)}}, where=case)
    prepared = ensure_prepared(cfg, str(workdir / f"prepared_{kind}"), show_progress=False)
    hf_dir = base_model_dir(cfg, prepared, workdir / case)
    models = teacher(cfg, prepared, workdir / case) if name == "distill" else {}
    worker = RecipeWorker(recipe, to_dict(cfg), hf_dir, prepared, str(workdir / case), models)
    try:
        worker.before_training()
        batch = _unpadded(next(iter(worker.loader)))
        inputs = worker.recipe.inputs(batch, "train")
        units = int(batch[worker.recipe.unit_field])
        mapping = {SDPA_FWD: _sdpa_fwd, SDPA_BWD: _sdpa_bwd, aten.addmm_: _addmm_,
                   aten._grouped_mm: grouped_mm_flops}          # MoE experts and their adapters
        grouped_mm_available(torch.device("cpu"), torch.float32)   # probe outside the counter
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            worker.engine.train_step([inputs], units)
        by_op = counter.get_flop_counts()["Global"]
        sdpa_fwd, sdpa_bwd = by_op.get(SDPA_FWD, 0), by_op.get(SDPA_BWD, 0)
        assert sdpa_fwd > 0 and sdpa_bwd > 0, dict(by_op)
        attention = (sdpa_fwd + sdpa_bwd * 4 / 5) * _causal_fraction(batch["document_lengths"][0])
        executed = counter.get_total_flops() - sdpa_fwd - sdpa_bwd + attention
        recompute = _logit_recompute(worker, batch)
        counted = worker.recipe.flops(batch)
    finally:
        worker.close()
    assert abs(executed - recompute - counted) / counted < RTOL, \
        (case, executed, recompute, counted)


def _logit_recompute(worker, batch: dict) -> float:
    """What the chunked loss ops execute beyond model FLOPs: their backward recomputes each
    chunk's logits, one more forward of every head in the loss over the labelled positions
    (the student's, and in distillation the teacher's too)."""
    labelled = int(batch["num_loss_tokens"])
    heads = [worker.engine.args]
    if worker.recipe.name == "reward":
        return 0.0                     # a scalar head at one position per sequence, no chunks
    if worker.recipe.name in ("sft", "sequence"):
        return 0.0                     # chunked_cross_entropy forms its gradients in forward
    if worker.recipe.name == "distill" and worker.recipe.teacher is not None:
        heads.append(worker.recipe.teacher.args)
    return sum(2.0 * a.hidden_size * a.vocab_size * labelled for a in heads)


@pytest.mark.parametrize("reference", ["none", "copy"])
def test_grpo_update_flops_match_the_flop_counter(reference, workdir):
    """GRPO's update (two mini-batches, so an old-policy forward too; and the frozen reference
    copy's forward) against FlopCounterMode; the entropy diagnostic is off here (an extra head
    pass for logging, not model work). The loss forms the head's gradients in the forward, so
    nothing is recomputed: executed equals counted (with the log-prob kernel's recompute it
    was one head projection per trained token more)."""
    from posttrain.config.loader import to_dict
    from posttrain.config.recipes import load_recipe
    from posttrain.rl.batch import Sample, pack_micro_batches, split_mini_batches
    from posttrain.train.grpo import GRPOConfig, GRPOWorker
    from steps.common import base_model_dir, ensure_prepared

    cfg = load_recipe(ROOT / "configs/grpo/tiny.yaml", GRPOConfig, {
        "run.dir": str(workdir / f"grpo_{reference}"), "model.hf_dir": None,
        "model.init": {"family": "qwen3", "seed": 0, "overrides": _MODEL},
        "model.loss_chunk_tokens": 32, "algorithm.log_entropy": False,
        "algorithm.reference": reference, "algorithm.kl_coef": 0.01 if reference != "none"
        else 0.0, "train.parallel": {"activation_checkpointing": "none"}})
    prepared = ensure_prepared(cfg, str(workdir / "prepared_prompts"), show_progress=False)
    hf_dir = base_model_dir(cfg, prepared, workdir / f"grpo_{reference}")
    worker = GRPOWorker(to_dict(cfg), hf_dir, prepared, str(workdir / f"grpo_{reference}"))
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(3, 200, (int(torch.randint(6, 20, (1,), generator=gen)),),
                               generator=gen).tolist()
        completion = torch.randint(3, 200, (int(torch.randint(4, 30, (1,), generator=gen)),),
                                   generator=gen).tolist()
        samples.append(Sample(prompt, completion, [-1.0] * len(completion), (i % 3) - 1.0))
    mini = [pack_micro_batches(mb, max_tokens=64) for mb in split_mini_batches(samples, 2)]
    counted = worker.update_flops(mini)
    mapping = {SDPA_FWD: _sdpa_fwd, SDPA_BWD: _sdpa_bwd, aten.addmm_: _addmm_}
    try:
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            out = worker.train_rollouts(mini)
    finally:
        worker.close()
    assert out["step_flops"] == counted and out["mfu"] > 0
    by_op = counter.get_flop_counts()["Global"]
    sdpa_fwd, sdpa_bwd = by_op.get(SDPA_FWD, 0), by_op.get(SDPA_BWD, 0)
    live = [b for mbs in mini for b in mbs]
    docs = [n for b in live for n in b["document_lengths"][0]]
    attention = (sdpa_fwd + sdpa_bwd * 4 / 5) * _causal_fraction(docs)
    executed = counter.get_total_flops() - sdpa_fwd - sdpa_bwd + attention
    assert abs(executed - counted) / counted < RTOL, (executed, counted)
