"""The reward-model recipe's parts: config, loss module, per-rank worker, export and loader.

The model is the LM body with its head replaced by a scalar projection (the custom-head path:
``model.head = nn.Linear(H, 1)``, initialized by the engine, not read from the checkpoint).
The reward of a sequence is the head's output at its last response token (the last token with
``loss_mask == 1``); the pair loss is Bradley-Terry (`posttrain.losses.reward.bt_loss`), summed
over pairs, the engine dividing by the step's global pair count. Data rule, steps and
checkpoints are the recipe kernel's (`posttrain.train.recipe`).

Export (rank 0): ``<dir>/`` is a Hugging Face causal-LM checkpoint of the body (the starting
model's LM head kept for untied models, so that any HF loader reads it), plus
``reward_head.safetensors`` (``weight`` [1, H], ``bias`` [1]) and ``reward_head.json``
describing how to use it. `load_reward_model(dir)` returns a ``score(prompt_messages,
completion_text) -> float`` callable, usable as a GRPO reward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.config.reward import RewardConfig
from posttrain.losses.reward import bt_loss
from posttrain.models.reward_model import HEAD_FILE, HEAD_JSON
from posttrain.models.transformer import Transformer
from posttrain.ops.cross_entropy import IGNORE_INDEX
from posttrain.train.dpo import pair_postfix, pair_result, pair_summary
from posttrain.train.recipe import Recipe, eval_suite, policy_flops


def last_response_index(labels_BT: torch.Tensor, sequence_ids_BT: torch.Tensor,
                        num_sequences: int) -> torch.Tensor:
    """Flat index of each sequence's last response token: its last labelled position + 1
    (labels are shifted: position t predicts token t + 1)."""
    labelled_N = labels_BT.reshape(-1) != IGNORE_INDEX
    pos_N = torch.arange(labelled_N.numel(), device=labels_BT.device)
    seq_K = sequence_ids_BT.reshape(-1)[labelled_N]
    last_S = torch.full((num_sequences,), -1, dtype=torch.int64, device=labels_BT.device)
    last_S = last_S.scatter_reduce(0, seq_K, pos_N[labelled_N], reduce="amax")
    if bool((last_S < 0).any()):
        raise ValueError("a sequence of the batch has no response token")
    return last_S + 1


class RewardLoss(nn.Module):
    """FSDP root: body -> scalar head at each sequence's last response token -> BT loss sum."""

    input_keys = ("input_ids", "labels", "position_ids", "document_lengths", "sequence_ids",
                  "pair_index")

    def __init__(self, model: Transformer):
        super().__init__()
        model.head = nn.Linear(_hidden_size(model), 1, device="meta")
        self.model = model

    def forward(self, input_ids, labels, position_ids, document_lengths, sequence_ids,
                pair_index):
        hidden_BTH = self.model(input_ids, position_ids, document_lengths)
        num_seq = int(sequence_ids.max()) + 1
        last_S = last_response_index(labels, sequence_ids, num_seq)
        reward_S = self.model.head(hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[last_S])
        reward_S = reward_S.squeeze(-1).float()
        chosen_P, rejected_P = reward_S[pair_index[:, 0]], reward_S[pair_index[:, 1]]
        loss, m = bt_loss(chosen_P, rejected_P, reduction="sum")
        n = chosen_P.shape[0]
        return loss, {"accuracy": m["accuracy"] * n, "margins": m["margin"] * n,
                      "rewards_chosen": chosen_P.detach().sum(),
                      "rewards_rejected": rejected_P.detach().sum()}


def _hidden_size(model: nn.Module) -> int:
    """The width of the hidden states the head reads (a native model's args, or a transformers
    fallback's config)."""
    args = getattr(model, "args", None)
    return args.hidden_size if args is not None else model.hidden_size


class Reward(Recipe):
    """A reward model: the Bradley-Terry loss over pairs, a scalar head, its own export.

    A model without a native definition (`posttrain.models.fallback.HFCausalLM`) takes the
    scalar head the same way (``model.head = ...`` registers it beside transformers' unused LM
    head, which stays as it was and is exported with the body)."""

    name = "reward"
    config_cls = RewardConfig
    unit_field, unit_name = "num_pairs", "pairs"

    def loss_root(self, model: Transformer) -> nn.Module:
        return RewardLoss(model)

    def flops(self, batch: dict) -> float:
        """The body's forward and backward over the real tokens; the scalar head (H x 1 at one
        position per sequence) is negligible and not counted."""
        return policy_flops(self.worker.engine.model, batch, head=False)

    def export(self, out_dir: str) -> str | None:
        """HF body + reward head (rank 0); a collective, every rank must call it."""
        w = self.worker
        state = w.engine.full_state_dict()
        if w.rank != 0:
            return None
        return export_reward_model(state, w.engine, out_dir,
                                   tokenizer_dir=f"{w.prepared_dir}/tokenizer")

    @staticmethod
    def eval_suite(cfg: RewardConfig, models: dict[str, str]) -> Any:
        """Held-out pairs scored by the exported reward model, loaded as GRPO loads it."""
        return eval_suite(cfg, "reward_model")

    postfix = staticmethod(pair_postfix)
    result = staticmethod(pair_result)
    summary = staticmethod(pair_summary)


def export_reward_model(state: dict[str, torch.Tensor], engine: Any, out_dir: str, *,
                        tokenizer_dir: str) -> str:
    from posttrain.models.hf_io import iter_hf_tensors
    from posttrain.train.build import fit_vocab
    from posttrain.train.export import export_hf
    head = {k[len("head."):]: state.pop(k) for k in list(state) if k.startswith("head.")}
    args = engine.args
    if args is None:                         # transformers: its LM head is still in the state
        from posttrain.train.export import export_fallback
        export_fallback(state, engine.hf_dir, out_dir, tokenizer_dir=tokenizer_dir)
        return _write_head(Path(out_dir), head, engine.model.hidden_size)
    if not args.tie_word_embeddings:         # keep the starting LM head: a loadable CausalLM
        base = engine.model_cfg.hf_dir or engine.hf_dir
        from posttrain.models.hf_io import load_hf
        base_args = load_hf(base, on_meta=True, param_filter=lambda n: False).args
        for name, t in iter_hf_tensors(base, base_args, names={"head.weight"}):
            state[name] = fit_vocab(name, t, base_args, args)
    export_hf(state, args, out_dir, fmt="full", tokenizer_dir=tokenizer_dir)
    return _write_head(Path(out_dir), head, args.hidden_size)


def _write_head(out: Path, head: dict[str, torch.Tensor], hidden_size: int) -> str:
    """The reward head's files beside an exported body."""
    from safetensors.torch import save_file

    from posttrain.train.export import write_weight_index
    write_weight_index(out, exclude={HEAD_FILE})
    save_file({k: v.contiguous() for k, v in head.items()}, str(out / HEAD_FILE))
    (out / HEAD_JSON).write_text(json.dumps({
        "kind": "scalar_reward_head", "hidden_size": hidden_size, "bias": "bias" in head,
        "weights": HEAD_FILE, "pooling": "last_response_token",
        "input": "chat template of prompt + one assistant turn (the tokenizer in this dir)",
        "loss": "bradley_terry"}, indent=2))
    return str(out)
