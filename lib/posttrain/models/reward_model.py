"""An exported reward model, read back: the body (any family, native or transformers) with
its scalar head, and its tokenizer. `posttrain.train.reward` trains and exports one (the head's
files beside the body); GRPO's model rewards (`posttrain.rl.model_rewards`) and the
``reward_model`` suite kind (`posttrain.eval.suites`) score with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from posttrain.data.tokenizer import TokenizerConfig

HEAD_FILE, HEAD_JSON = "reward_head.safetensors", "reward_head.json"


def load_reward_parts(model_dir: str, *, device: str = "cpu") -> tuple[nn.Module, Any]:
    """The exported reward model in `model_dir` in fp32 on `device` (its scalar head as
    ``model.head``, frozen, eval mode) and its `ChatTokenizer`."""
    from safetensors.torch import load_file

    from posttrain.data.tokenizer import ChatTokenizer
    from posttrain.models.auto import load_model
    meta = json.loads((Path(model_dir) / HEAD_JSON).read_text())
    if meta.get("kind") != "scalar_reward_head":
        raise ValueError(f"{model_dir}/{HEAD_JSON} does not describe a scalar reward head")
    model = load_model(model_dir, device=device, dtype=torch.float32).eval()
    head = nn.Linear(meta["hidden_size"], 1, bias=meta["bias"])
    head.load_state_dict(load_file(str(Path(model_dir) / meta["weights"])))
    model.head = head.to(device).eval()
    model.requires_grad_(False)
    return model, ChatTokenizer(TokenizerConfig(path=model_dir))


def reward_input_ids(tok: Any, prompt_messages: list[dict], completion_text: str) -> list[int]:
    """The ids a reward model scores: prompt + the completion as one assistant turn, through
    the completion's last trained token (the head reads the hidden state there)."""
    messages = [*prompt_messages, {"role": "assistant", "content": completion_text}]
    enc = tok.encode_chat(messages, train_on="last_assistant")
    trained = [i for i, m in enumerate(enc.loss_mask) if m]
    if not trained:
        raise ValueError("the completion has no token to score")
    return enc.input_ids[:trained[-1] + 1]


def load_reward_model(model_dir: str, *, device: str = "cpu"
                      ) -> Callable[[list[dict], str], float]:
    """``score(prompt_messages, completion_text) -> float`` from an exported reward model, one
    sequence per forward (`posttrain.rl.model_rewards.RewardModelScorer` scores batches)."""
    model, tok = load_reward_parts(model_dir, device=device)

    @torch.no_grad()
    def score(prompt_messages: list[dict], completion_text: str) -> float:
        ids = torch.tensor([reward_input_ids(tok, prompt_messages, completion_text)],
                           device=device)
        hidden = model(ids)
        return float(model.head(hidden[0, -1]).squeeze())

    return score
