"""What the DPO and reward-model recipes share: pair data on a rank, steps, eval, checkpoints.

Data rule: the one of SFT (`posttrain.train.sft`): every rank reads the same global stream of
micro-batches (the loader in ``format: preference``, chosen and rejected of a pair packed as two
documents of one unit); optimizer step s consumes global micro-batches [s*G, (s+1)*G) and rank r
of W trains those with index = r (mod W). The loss is a mean over the step's *pairs*: the
engine normalizes by the global pair count, so the gradient does not depend on how the pairs
fell into micro-batches or ranks.

A recipe subclasses `PairWorker` and supplies its loss module (`loss_module`), what each batch
needs beside the tokens (`add_inputs`, e.g. reference log-probs) and its export.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn

from posttrain.data.loader import LoaderConfig, TrainLoader, sources_from_manifest
from posttrain.data.prepared import local_view
from posttrain.errors import DataError
from posttrain.models.transformer import Transformer
from posttrain.train.engine import Engine
from posttrain.train.metrics import peak_memory_bytes
from posttrain.train.sft import _tokenizer_vocab

log = logging.getLogger(__name__)


class PairWorker:
    """One rank of a pair-trained recipe: an `Engine` and a view of the global pair stream.

    `cfg` is the recipe's validated config with fields ``model``, ``train`` (an
    `SFTTrainConfig`-shaped engine config with ``loader`` and ``micro_batches_per_step``) and
    ``eval.max_batches``.
    """

    def __init__(self, cfg: Any, hf_dir: str, prepared_dir: str, run_dir: str):
        self.cfg = cfg
        self.prepared_uri = prepared_dir
        self.prepared_dir = local_view(prepared_dir)
        self.run_dir = run_dir
        self.engine = Engine(cfg.model, cfg.train, hf_dir, run_dir,
                             loss_factory=self.loss_module,
                             vocab_size=_tokenizer_vocab(prepared_dir))
        self.rank, self.world = self.engine.rank, self.engine.world   # the engine joined the group
        self.loader = TrainLoader(sources_from_manifest(prepared_dir, "train"), cfg.train.loader)
        self._batches = None
        self.pairs_seen = 0

    # ------------------------------------------------------------------ recipe hooks
    def loss_module(self, model: Transformer) -> nn.Module:
        raise NotImplementedError

    def add_inputs(self, batch: dict, split: str) -> dict:
        """Fields the loss module needs beyond the loader's (default: none)."""
        return batch

    # ------------------------------------------------------------------ driver API
    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world, "params": self.engine.num_params,
                "trainable_params": self.engine.num_trainable, "device": str(self.engine.device),
                "micro_batches_per_step": self.cfg.train.micro_batches_per_step}

    def resume(self) -> int:
        """Load the newest valid checkpoint if any; returns the step to continue from."""
        extra = self.engine.load_checkpoint()
        if extra is not None:
            self.loader.load_state_dict(extra["loader"])
            self.pairs_seen = int(extra["pairs_seen"])
        return self.engine.step

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; None when the data is exhausted before a full step."""
        if self._batches is None:
            self._batches = iter(self.loader)
        t0 = time.perf_counter()
        g = self.cfg.train.micro_batches_per_step
        batches = [b for _, b in zip(range(g), self._batches)]
        if len(batches) < g:
            return None
        data_s = time.perf_counter() - t0
        pairs = sum(b["num_pairs"] for b in batches)
        mine = [self.add_inputs(b, "train") for b in self.engine.dp.share(batches)]
        metrics = self.engine.train_step(mine, pairs)
        self.pairs_seen += pairs
        real = sum(b["num_real_tokens"] for b in batches)
        pad = sum(b["num_pad_tokens"] for b in batches)
        seconds = time.perf_counter() - t0
        metrics.update({"pairs": pairs, "pairs_seen": self.pairs_seen, "real_tokens": real,
                        "padding_fraction": pad / max(real + pad, 1),
                        "pairs_per_s": pairs / seconds, "real_tokens_per_s": real / seconds,
                        "data_wait_s": data_s, "step_total_s": seconds,
                        "peak_memory_bytes": peak_memory_bytes(self.engine.device)})
        return metrics

    def save_checkpoint(self) -> str:
        return self.engine.save_checkpoint({"loader": self.loader.state_dict(),
                                            "pairs_seen": self.pairs_seen})

    def eval_batches(self, split: str = "eval") -> list[dict]:
        """The held-out pair batches (one pass, no shuffle), at most eval.max_batches."""
        try:
            sources = sources_from_manifest(self.prepared_dir, split)
        except DataError as e:
            log.warning("no %s split: %s", split, e)
            return []
        with TrainLoader(sources, one_pass(self.cfg.train.loader)) as loader:
            return [b for _, b in zip(range(self.cfg.eval.max_batches), loader)]

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and the loss module's metrics, means over the eval pairs.

        Batches are split over ranks; under FSDP every rank must run the same number of
        forwards, so a rank with one batch fewer repeats its first batch without counting it.
        """
        batches = self.eval_batches("eval")
        if not batches:
            return {}
        sums = self.sum_over_ranks(batches, "eval")
        pairs = sum(b["num_pairs"] for b in batches)
        return {**{f"eval_{k}": v / max(pairs, 1) for k, v in sums.items()},
                "eval_pairs": pairs, "eval_batches": len(batches)}

    def sum_over_ranks(self, batches: list[dict], split: str) -> dict[str, float]:
        dp = self.engine.dp
        mine = dp.share(batches)
        sums: dict[str, float] = {}
        for b in mine:
            for k, v in self.engine.eval_sums(self.add_inputs(b, split)).items():
                sums[k] = sums.get(k, 0.0) + v
        for _ in range(dp.rounds(len(batches)) - len(mine)):
            self.engine.eval_sums(self.add_inputs(batches[0], split))
        return {k: dp.sum(v) for k, v in sorted(sums.items())}

    def close(self) -> None:
        self.loader.close()


def one_pass(cfg: LoaderConfig) -> LoaderConfig:
    """The loader config for reading a split once, in order (eval, reference pass)."""
    return LoaderConfig(packing=cfg.packing, mode=cfg.mode, format=cfg.format,
                        rows_per_batch=cfg.rows_per_batch, epochs=1, background=False)
