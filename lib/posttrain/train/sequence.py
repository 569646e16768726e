"""The sequence recipe: pretrain a native model from scratch on event sequences, with heads.

The data are sequences of event or item ids (``data.format: sequence``) whose vocabulary comes
from the config (``vocab:``, `posttrain.data.events`: specials, items, semantic-ID codes), not
from a text tokenizer. The model is a native decoder (``model.init``: a family and its sizes,
written as a random initial HF checkpoint by the driver, or ``model.hf_dir`` to continue)
whose LM head predicts the next token (the next item), plus the configured per-position heads
(``heads.per_position``, `posttrain.models.heads`): classification (cross-entropy) or
regression (squared error), each with a loss weight, trained on the labels the rows carry.
The objective and its normalization are `posttrain.losses.sequence`'s: a mean over the step's
next-item targets, so the unit of the loss is the next-item target (`num_loss_tokens`), as in
SFT.

Everything else is the recipe kernel's (`posttrain.train.recipe`): packing with document
boundaries (the labels travel with their tokens as side columns of the packer), the data rule,
checkpoints and exact resume, MFU (the FLOPs count the heads over their labelled positions).

Metrics: per step ``loss`` (the weighted objective), ``next_item_loss`` and per head
``<name>_loss`` (its mean over its labelled positions), ``<name>_accuracy`` (classification)
and ``<name>_labelled`` (the share of next-item targets with a label for it); held out the same
with an ``eval_`` prefix (``eval_<name>_labels``: their count), plus
``eval_next_item_accuracy`` (top-1 over the whole vocabulary, computed in eval only: it takes
one more pass of the LM head, which is not model work).

Export (rank 0): ``<dir>/`` is a Hugging Face causal-LM checkpoint (the LM head is the next-item
head; ``transformers.AutoModelForCausalLM.from_pretrained`` loads it), with
``event_vocab.json`` (the id layout) and the heads beside it (``heads.safetensors`` +
``heads.json``, loaded with `posttrain.models.heads.load_heads`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.config.sequence import HeadsConfig, SequenceConfig, SequenceEvalConfig
from posttrain.data.events import EventVocab, label_column
from posttrain.errors import DataError
from posttrain.losses.sequence import head_loss_sum, labelled, shift_to_next
from posttrain.losses.sft import sft_loss_sum
from posttrain.models.heads import HEADS_FILE, HeadConfig, PositionHeads, save_heads
from posttrain.models.transformer import Transformer
from posttrain.ops.cross_entropy import IGNORE_INDEX, chunked_argmax
from posttrain.train.recipe import Recipe, policy_flops

__all__ = ["export_sequence_model", "head_means", "head_targets", "HeadsConfig", "Sequence",
           "SequenceConfig", "SequenceEvalConfig", "SequenceLoss", "target_key",
           "write_special_ids"]


def target_key(name: str) -> str:
    """The batch field of head `name`'s targets (aligned with the positions predicting them)."""
    return f"target_{name}"


def head_targets(batch: dict, heads: dict[str, HeadConfig]) -> dict[str, torch.Tensor]:
    """Each head's targets [B, T] from the batch's label columns: the label of the next event
    (shifted within documents) or of the current one."""
    out = {}
    for name, h in heads.items():
        column = label_column(name)
        if column not in batch:
            raise DataError(f"the prepared data has no '{column}' column for head '{name}': "
                            "prepare it with this config's heads (labels)", field=column)
        values = batch[column]
        out[target_key(name)] = (shift_to_next(values, batch["position_ids"])
                                 if h.target == "next" else values)
    return out


class SequenceLoss(nn.Module):
    """FSDP root: body -> next-item chunked CE + per-position heads (`losses.sequence`).

    Returns the weighted loss sum and, per micro-batch, the sums behind the metrics: the
    next-item loss, and per head its loss, its labelled positions and (classification) its
    correct ones; in eval also the next-item top-1 hits.
    """

    def __init__(self, model: Transformer, heads: HeadsConfig, chunk_tokens: int = 1024):
        super().__init__()
        model.heads = PositionHeads(heads.per_position, model.args.hidden_size, device="meta")
        self.model = model
        self.next_item_weight = heads.next_item_weight
        self.kinds = {name: h.kind for name, h in heads.per_position.items()}
        self.weights = {name: h.weight for name, h in heads.per_position.items()}
        self.chunk_tokens = chunk_tokens
        self.input_keys = ("input_ids", "labels", "position_ids", "document_lengths",
                           *map(target_key, self.kinds))

    def forward(self, input_ids, labels, position_ids, document_lengths, *targets):
        hidden_BTH = self.model(input_ids, position_ids, document_lengths)
        lm = self.model.head
        softcap = getattr(lm, "softcap", None)
        next_item = sft_loss_sum(hidden_BTH, lm.weight, labels,
                                 real_vocab_size=lm.real_vocab_size,
                                 chunk_tokens=self.chunk_tokens, softcap=softcap)
        total = next_item * self.next_item_weight
        stats: dict[str, Any] = {"next_item_loss": next_item.detach()}
        hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        if not self.training:
            kept = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
            guess = chunked_argmax(hidden_NH.index_select(0, kept), lm.weight,
                                   real_vocab_size=lm.real_vocab_size,
                                   chunk_tokens=self.chunk_tokens, softcap=softcap)
            stats["next_item_correct"] = (guess == labels.reshape(-1)[kept]).sum()
        for (name, kind), target_BT in zip(self.kinds.items(), targets):
            target_N = target_BT.reshape(-1)
            kept = labelled(target_N).nonzero().squeeze(1)
            out = self.model.heads.project(name, hidden_NH.index_select(0, kept))
            loss, correct = head_loss_sum(kind, out, target_N.index_select(0, kept))
            total = total + loss * self.weights[name]
            stats[f"{name}_loss"] = loss.detach()
            stats[f"{name}_labelled"] = float(kept.numel())
            if correct is not None:
                stats[f"{name}_correct"] = correct
        return total, stats


def head_means(sums: dict[str, float], heads: dict[str, HeadConfig], prefix: str = ""
               ) -> dict[str, float]:
    """Per head, its mean loss and accuracy over its labelled positions, from the loss root's
    sums (or from sums all divided by one count: the ratios are the same). The sums used are
    removed from `sums`; the labelled count stays as ``<name>_labelled``."""
    out = {}
    for name, h in heads.items():
        n = sums[f"{name}_labelled"]
        out[f"{prefix}{name}_loss"] = sums.pop(f"{name}_loss") / n if n else math.nan
        if h.kind == "classification":
            out[f"{prefix}{name}_accuracy"] = sums.pop(f"{name}_correct") / n if n else math.nan
    return out


class Sequence(Recipe):
    """Pretraining on event sequences: next item + per-position heads, its own export."""

    name = "sequence"
    config_cls = SequenceConfig
    transformers_fallback = False          # the heads sit on the native model

    @property
    def heads(self) -> dict[str, HeadConfig]:
        return self.cfg.heads.per_position

    def loss_root(self, model: Transformer) -> nn.Module:
        return SequenceLoss(model, self.cfg.heads, self.cfg.model.loss_chunk_tokens)

    def inputs(self, batch: dict, split: str) -> dict:
        return {**batch, **head_targets(batch, self.heads)}

    def describe(self) -> dict[str, Any]:
        return {"vocab_size": EventVocab(self.cfg.vocab).vocab_size,
                "heads": {name: h.kind for name, h in self.heads.items()}}

    def flops(self, batch: dict) -> float:
        """The policy's (body, and LM head over the next-item targets; `policy_flops`) plus each
        head's matmul over its labelled positions: forward, input and weight gradients."""
        hidden = self.worker.engine.args.hidden_size
        total = policy_flops(self.worker.engine.model, batch)
        targets = head_targets(batch, self.heads)
        for name, h in self.heads.items():
            positions = int(labelled(targets[target_key(name)]).sum())
            total += 3 * 2.0 * hidden * h.out_features * positions
        return total

    def train_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        out = dict(metrics)
        out.update(head_means(out, self.heads))
        return out

    def eval_metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        sums = dict(sums)
        out = head_means(sums, self.heads, prefix="eval_")
        out.update({f"eval_{k}": v / max(units, 1) for k, v in sums.items()
                    if not k.endswith("_labelled")})
        out.update({f"eval_{name}_labels": int(sums[f"{name}_labelled"]) for name in self.heads})
        out["eval_next_item_accuracy"] = out.pop("eval_next_item_correct")
        out["eval_next_item_perplexity"] = math.exp(min(out["eval_next_item_loss"], 50.0))
        return out

    def export(self, out_dir: str) -> str | None:
        """HF causal LM + event_vocab.json + heads (rank 0); a collective, every rank calls it."""
        w = self.worker
        state = w.engine.full_state_dict()
        if w.rank != 0:
            return None
        return export_sequence_model(state, w.engine.args, self.cfg, out_dir,
                                     vocab_dir=f"{w.prepared_dir}/tokenizer")

    # ---------------------------------------------------------------- driver side
    @staticmethod
    def eval_suite(cfg: SequenceConfig, models: dict[str, str]) -> Any:
        """No evaluation suite for event sequences yet: the held-out metrics are the ones the
        run computes after training (``result["eval"]``)."""
        return None

    @staticmethod
    def postfix(m: dict) -> dict[str, str]:
        return {**Recipe.postfix(m), "next": f"{m['next_item_loss']:.3f}"}

    @staticmethod
    def summary(result: dict) -> list[str]:
        ev = result.get("eval") or {}
        lines = Recipe.summary(result)
        if ev:
            lines.append(f"held-out next item: accuracy {ev['eval_next_item_accuracy']:.3f}, "
                         f"loss {ev['eval_next_item_loss']:.4f} over {ev['eval_tokens']} "
                         "targets")
            for key in sorted(k for k in ev if k.endswith(("_accuracy", "_loss"))):
                if not key.startswith(("eval_next_item", "eval_loss")):
                    lines.append(f"held-out {key[len('eval_'):]}: {ev[key]:.4f}")
        return lines


def export_sequence_model(state: dict[str, torch.Tensor], args: Any, cfg: SequenceConfig,
                          out_dir: str, *, vocab_dir: str) -> str:
    """Write the HF checkpoint of `state` (the heads split off and saved beside it, the weight
    index naming only the LM's files) with the vocabulary's special ids in its config."""
    from posttrain.train.export import export_hf, write_weight_index
    prefix = "heads."
    heads = {k[len(prefix):]: state.pop(k) for k in list(state) if k.startswith(prefix)}
    export_hf(state, args, out_dir, fmt="full", tokenizer_dir=vocab_dir, dtype=cfg.export.dtype)
    out = Path(out_dir)
    save_heads(out, heads, cfg.heads.per_position, args.hidden_size)
    write_weight_index(out, exclude={HEADS_FILE})
    write_special_ids(out, EventVocab(cfg.vocab))
    return str(out)


def write_special_ids(out: Path, vocab: EventVocab) -> None:
    """Set the vocabulary's ``pad/bos/eos_token_id`` in the export's ``config.json``."""
    config = json.loads((out / "config.json").read_text())
    for name in ("pad", "bos", "eos"):
        config[f"{name}_token_id"] = vocab.special_id(name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

