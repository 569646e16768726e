"""What the multi-rank layout tests share: running a body on N gloo processes, the SFT loss root
that also returns the logits, full tensors of DTensors, and the comparison with the
single-process run."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def run_on_ranks(body: Callable[[str], dict], world: int, out_dir: Path) -> list[dict]:
    """`body(out_dir)` on `world` spawned processes joined in one gloo group (one torch thread
    each); returns each rank's result dict, failing with the first rank's traceback. `body`
    must be a module-level function (it is pickled by name)."""
    from posttrain.distributed import free_port
    mp.spawn(_rank_main, args=(world, free_port(), str(out_dir), body), nprocs=world, join=True)
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


def _rank_main(rank: int, world: int, port: int, out_dir: str,
               body: Callable[[str], dict]) -> None:
    from posttrain.distributed import close_process_group, init_process_group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        init_process_group(timeout_s=120)
        results = body(out_dir)
    except Exception:
        results = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    if "error" in results:
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    close_process_group()
    os._exit(0)   # skip finalization, where gloo objects held by FSDP modules may abort


class LossAndLogits(nn.Module):
    """The SFT root (mean cross-entropy over the step's loss tokens) that also returns the
    logits. FSDP averages gradients over the ranks it shards over (`ranks`): the loss is scaled
    so that their mean is the gradient of the global mean."""

    def __init__(self, model: nn.Module, global_tokens: int, ranks: int):
        super().__init__()
        self.model, self.global_tokens, self.ranks = model, global_tokens, ranks

    def forward(self, ids, labels, docs):
        from posttrain.losses.sft import sft_loss_sum
        hidden = self.model(ids, document_lengths=docs)
        head = self.model.head
        loss_sum = sft_loss_sum(hidden, head.weight, labels, real_vocab_size=head.real_vocab_size,
                                softcap=getattr(head, "softcap", None))
        return loss_sum * self.ranks / self.global_tokens, self.model.logits(hidden).detach()


def randomize_adapters(model: nn.Module, std: float = 0.05, seed: int = 1) -> None:
    """Every LoRA factor (attention's A/B, the experts' stacked {p}_lora_A/B) drawn from
    normal(0, std), so that both factors get gradients. Not larger than 0.05: at 0.1 (with
    alpha / r = 2) the tiny Qwen3.5 models are so ill-conditioned that 1e-7 relative noise on
    the adapters moves their gradients by 5e-5 in one process (measured), so no layout could
    be compared at 1e-5; at 0.05 the same noise moves them by 1e-7."""
    from posttrain.models.lora import lora_modules
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(model):
            for name, p in module.named_parameters():
                if name.endswith(("lora_A", "lora_B")):
                    p.copy_(torch.randn(p.shape, generator=gen) * std)


def token_batch(rows: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random (input ids, labels) [rows, seq_len]: labels are the ids shifted by one."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def assert_layouts_match(per_rank: list[dict], key: tuple, atol: float) -> None:
    """Every rank's `compare` result for `key` within `atol` (loss, logits, every gradient),
    with the same gradients present."""
    for rank, results in enumerate(per_rank):
        d = results[key]
        where = f"{' '.join(map(str, key))} rank {rank}: {d}"
        assert not d["grad_names_differ"] and d["num_grads"] > 0, where
        assert d["loss"] <= atol and d["logits"] <= atol and d["grads"] <= atol, where


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(ref: dict, got: dict) -> dict:
    """Differences of a layout's run (`got`: its rows, and with context parallelism its
    positions, of the logits) from the single-process run (`ref`)."""
    ref_logits = ref["logits"][got["rows"]]
    if got.get("positions") is not None:
        ref_logits = ref_logits[:, got["positions"]]
    common = [n for n in ref["grads"] if n in got["grads"]]
    return {"loss": abs(ref["loss"] - got["loss"]),
            "logits": (ref_logits - got["logits"]).abs().max().item(),
            "grads": max((ref["grads"][n] - got["grads"][n]).abs().max().item() for n in common),
            "worst_grad": max(common, key=lambda n: (ref["grads"][n] - got["grads"][n])
                              .abs().max()),
            "grad_names_differ": sorted(set(ref["grads"]) ^ set(got["grads"])),
            "num_grads": len(got["grads"])}
