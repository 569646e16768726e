"""Per-position output heads beside the LM head, and how they are saved and loaded.

A model trained on event sequences (`posttrain.train.sequence`) predicts at every position the
next token with its LM head (the next item) and, with these heads, other per-position targets
from the same final-normed hidden state h_t:

    classification (num_classes C):  logits_t = W h_t + b,  W [C, H]
    regression:                      y_t      = w h_t + b,  w [1, H]

Each head's target is the label of the next event (``target: next``, as for the next item) or
of the current one (``target: current``). The heads live on the native model as
``model.heads`` (a `PositionHeads`: parameters ``heads.<name>.weight`` / ``.bias``), so the
engine shards, initializes and checkpoints them with the model; they are not part of the
Hugging Face checkpoint. The export writes them beside it:

    <dir>/heads.safetensors   <name>.weight [C or 1, H], <name>.bias [C or 1]
    <dir>/heads.json          hidden size, and per head its kind, classes, target, loss weight

`load_heads(dir)` returns a `PositionHeads` holding them, to apply to the hidden states of the
causal LM in the same directory (transformers: ``model.model(input_ids).last_hidden_state``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.config.model import HeadConfig

HEADS_FILE, HEADS_JSON = "heads.safetensors", "heads.json"


class PositionHeads(nn.ModuleDict):
    """Linear heads over hidden states [..., H]: {name: logits [..., C] or values [...]}.

    A module dict of `nn.Linear` by head name, so its parameters are ``<name>.weight`` /
    ``<name>.bias``, the names of ``heads.safetensors``."""

    def __init__(self, configs: dict[str, HeadConfig], hidden_size: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.configs = dict(configs)
        self.hidden_size = hidden_size
        for name, c in self.configs.items():
            if not name.isidentifier() or hasattr(self, name):
                raise ConfigError(f"head name {name!r}: use an identifier that is not an "
                                  f"attribute of PositionHeads")
            self[name] = nn.Linear(hidden_size, c.out_features, device=device, dtype=dtype)

    def project(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """Head `name` over hidden [..., H]: logits [..., C], or values [...] (regression)."""
        out = self[name](hidden)
        return out.squeeze(-1) if self.configs[name].kind == "regression" else out

    def forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.project(name, hidden) for name in self.configs}


def save_heads(out_dir: str | Path, tensors: dict[str, torch.Tensor],
               configs: dict[str, HeadConfig], hidden_size: int) -> Path:
    """Write ``heads.safetensors`` (`tensors`: ``<name>.weight`` / ``<name>.bias``) and
    ``heads.json`` into `out_dir`; the module docstring has the layout."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    want = {f"{n}.{p}" for n in configs for p in ("weight", "bias")}
    if set(tensors) != want:
        raise ValueError(f"head tensors {sorted(tensors)} do not match the heads {sorted(want)}")
    save_file({k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())},
              str(out / HEADS_FILE))
    (out / HEADS_JSON).write_text(json.dumps({
        "kind": "position_heads", "hidden_size": hidden_size, "weights": HEADS_FILE,
        "input": "the final-normed hidden state at each position of the causal LM in this "
                 "directory (transformers: model.model(input_ids).last_hidden_state)",
        "next_item": "the causal LM's own head (lm_head) over the ids of event_vocab.json",
        "heads": {name: {"kind": c.kind, "num_classes": c.num_classes, "target": c.target,
                         "weight": c.weight} for name, c in configs.items()}},
        indent=2) + "\n")
    return out


def load_heads(model_dir: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> PositionHeads:
    """The heads saved beside an exported checkpoint (`save_heads`), in eval mode."""
    from safetensors.torch import load_file
    meta_path = Path(model_dir) / HEADS_JSON
    if not meta_path.is_file():
        raise FileNotFoundError(f"no {HEADS_JSON} in {model_dir}: not a sequence-recipe export")
    meta = json.loads(meta_path.read_text())
    if meta.get("kind") != "position_heads":
        raise ValueError(f"{meta_path} does not describe position heads")
    configs = {name: HeadConfig(**c) for name, c in meta["heads"].items()}
    heads = PositionHeads(configs, meta["hidden_size"])
    heads.load_state_dict(load_file(str(Path(model_dir) / meta["weights"])))
    return heads.to(device=device, dtype=dtype).eval()
