"""The recipe kernel: what every method that trains through the `Engine` shares.

A recipe (SFT, DPO, reward model, distillation) is a small class: its config class, its loss
root (the FSDP root module the engine runs), a batch function (what each batch needs beside the
loader's tensors, e.g. reference log-probs), its unit of loss (loss tokens or pairs), its FLOPs,
optional hooks (`ready`: after the engine is built, e.g. the online teacher's weights;
`before_training`: before resume, e.g. DPO's reference pass), its held-out evaluation and its
export. One `RecipeWorker` runs any of them on a rank; one driver (`steps.common.run_recipe`)
runs the workers: prepare -> base model -> launch -> before training -> resume -> step loop ->
evaluate -> export -> result.

Data rule (documented contract): the data order is defined globally, independent of the number
of workers. Every rank reads the same global stream of packed micro-batches; optimizer step s
consumes global micro-batches [s*G, (s+1)*G), and data-parallel rank r of D trains on those with
index = r (mod D) (`Engine.dp`; the ranks of one tensor-parallel group share data). The loss is
a mean over the step's units (loss tokens, or pairs), normalized by the step's global unit
count, so the gradient does not depend on how the units fell into micro-batches or ranks. A
checkpoint stores the global stream position at a step boundary, so a run resumed on a different
number of workers (any that divides G) continues with exactly the same global batches.

Configs compose the parts' configs: a recipe's ``train:`` section is a `TrainConfig`, which holds
the engine's own `EngineConfig` inline (its keys sit directly under ``train:``), so the Engine
receives only engine fields.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, ClassVar

import torch
from torch import nn

from posttrain.config.loader import build
from posttrain.config.train import (ExportConfig, RunConfig, TrainConfig, check_context_parallel,
                                    check_eval_tasks, check_export, check_step_split)
from posttrain.data.loader import (LoaderConfig, StreamLoader, TrainLoader,
                                   sources_from_manifest)
from posttrain.data.prepared import local_view
from posttrain.errors import ConfigError, DataError
from posttrain.models.transformer import Transformer
from posttrain.train.metrics import batch_counts, device_peak_flops, step_metrics

__all__ = ["check_context_parallel", "check_eval_tasks", "check_export", "check_step_split",
           "eval_suite", "ExportConfig", "head_flops", "one_pass", "policy_flops", "Recipe",
           "RecipeWorker", "RunConfig", "tokenizer_added_ids", "tokenizer_vocab", "TrainConfig"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- shared config parts


def one_pass(cfg: LoaderConfig) -> LoaderConfig:
    """The loader config for reading a split once, in order (eval, a reference pass)."""
    return LoaderConfig(packing=cfg.packing, mode=cfg.mode, format=cfg.format,
                        rows_per_batch=cfg.rows_per_batch, epochs=1, background=False)


def tokenizer_vocab(prepared_dir: str) -> int | None:
    """The tokenizer's vocabulary size recorded by prepare (added tokens included)."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    with fs.open(f"{root.rstrip('/')}/manifest.json") as f:
        return json.load(f)["tokenizer"].get("vocab_size")


def tokenizer_added_ids(prepared_dir: str) -> tuple[int, ...]:
    """The ids of the tokens the tokenizer config added to the vocabulary (`tokenizer.
    added_tokens`, `semantic_ids`), recorded by prepare: base_vocab_size .. vocab_size - 1."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(prepared_dir)
    with fs.open(f"{root.rstrip('/')}/manifest.json") as f:
        tok = json.load(f)["tokenizer"]
    base, vocab = tok.get("base_vocab_size"), tok.get("vocab_size")
    return tuple(range(base, vocab)) if base is not None and vocab is not None else ()


# --------------------------------------------------------------------------- the recipe protocol


class Recipe:
    """What a method adds to the kernel; one instance per rank, bound to its `RecipeWorker`.

    The defaults are SFT's (causal-LM loss over loss tokens). Driver-side parts (`postfix`,
    `summary`, `result`) are static: the driver never builds a rank's recipe.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type]
    transformers_fallback: ClassVar[bool] = True   # runs on models without a native definition
    # the batch count the loss is a mean over, and how metrics name that unit; a recipe whose
    # unit depends on its config sets them per instance (the preference recipe: pairs, or
    # KTO's completions)
    unit_field: str = "num_loss_tokens"
    unit_name: str = "tokens"

    def __init__(self, worker: "RecipeWorker"):
        self.worker = worker
        self.cfg = worker.cfg

    # ---------------------------------------------------------------- rank side
    def loss_root(self, model: Transformer) -> nn.Module:
        """The FSDP root around the (meta) policy model; see `posttrain.train.engine`."""
        from posttrain.train.engine import CausalLMLoss
        return CausalLMLoss(model, self.cfg.model.loss_chunk_tokens)

    def ready(self) -> None:
        """After the engine is built and filled (e.g. stream a frozen teacher's weights)."""

    def train_loader(self) -> Any:
        """The global stream (every rank reads it whole), or with ``train.loader.streams`` S > 1
        this data-parallel rank's streams r, r + D, ... (`posttrain.data.loader.StreamLoader`)."""
        w, cfg = self.worker, self.cfg.train.loader
        sources = sources_from_manifest(w.prepared_uri, "train")
        if cfg.streams == 1:
            return TrainLoader(sources, cfg)
        dp = w.engine.dp
        return StreamLoader(sources, cfg, own=list(range(dp.rank, cfg.streams, dp.size)))

    def inputs(self, batch: dict, split: str) -> dict:
        """The batch as the loss root takes it (default: the loader's fields)."""
        return batch

    def before_training(self) -> dict[str, Any]:
        """Before resume, with the starting weights (e.g. DPO's reference pass)."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the recipe itself changes during training (JSON; e.g. KTO's reference point),
        saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` on resume."""

    def split_batches(self, split: str, limit: int | None = None) -> list[dict]:
        """One pass over a prepared split, in order, no shuffle (at most `limit` batches)."""
        sources = sources_from_manifest(self.worker.prepared_dir, split)
        with TrainLoader(sources, one_pass(self.cfg.train.loader)) as loader:
            return list(loader) if limit is None else \
                [b for _, b in zip(range(limit), loader)]

    def eval_batches(self) -> list[dict]:
        """The held-out batches, at most eval.max_batches."""
        try:
            return self.split_batches("eval", self.cfg.eval.max_batches)
        except DataError as e:
            log.warning("no eval split: %s", e)
            return []

    def train_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A step's metrics as logged, from the engine's, whose loss-root stats are sums over
        the step divided by its units (e.g. a ratio of two stats); default: as they are."""
        return metrics

    def eval_metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        """Held-out metrics from the loss root's sums over the eval units."""
        return {f"eval_{k}": v / max(units, 1) for k, v in sums.items()}

    def flops(self, batch: dict) -> float:
        """Model FLOPs this batch's step executes: the policy's forward and backward over the
        real tokens (per-document attention, LoRA's adapters), the LM head over the labelled
        positions only (the chunked loss drops the others before projecting)."""
        return policy_flops(self.worker.engine.model, batch, lora=self.cfg.model.lora)

    def export(self, out_dir: str) -> str | None:
        """Write the HF checkpoint (rank 0); a collective, every rank calls it."""
        from posttrain.train.export import export_worker
        w = self.worker
        return export_worker(w.engine, self.cfg, w.prepared_dir, out_dir)

    # ---------------------------------------------------------------- driver side
    @staticmethod
    def eval_suite(cfg: Any, models: dict[str, str]) -> Any:
        """The held-out evaluation of an exported checkpoint, as a suite
        (`posttrain.eval.suites`) over the config's `data.eval` sources; `models` are the
        run's other model directories (a teacher). SFT's: held-out loss and perplexity
        against the starting model, and a few greedy answers."""
        from posttrain.config.eval import GenerationSettings
        gen = cfg.eval.generate
        return eval_suite(cfg, "heldout_loss", lambda i: {
            "format": cfg.data.format,
            **({"samples": gen.num_samples,
                "generation": GenerationSettings(max_new_tokens=gen.max_new_tokens)}
               if i == 0 and cfg.data.format == "chat" and gen.num_samples else {})})

    @staticmethod
    def postfix(m: dict) -> dict[str, str]:
        """The progress bar's fields of a step's metrics."""
        return {"loss": f"{m['loss']:.3f}", "tok/s": f"{m['real_tokens_per_s']:.0f}",
                "mfu": f"{m['mfu']:.1%}"}

    @staticmethod
    def result(history: list[dict]) -> dict[str, Any]:
        """What the run's result adds from the steps run here."""
        if not history:
            return {}
        n = len(history)
        return {"final_loss": history[-1]["loss"],
                "mean_real_tokens_per_s": sum(m["real_tokens_per_s"] for m in history) / n,
                "mean_mfu": sum(m["mfu"] for m in history) / n}

    @staticmethod
    def summary(result: dict) -> list[str]:
        """Lines for the console after a run."""
        if "final_loss" not in result:
            return []
        return [f"final train loss {result['final_loss']:.4f}; "
                f"{result['mean_real_tokens_per_s']:.0f} real tokens/s; "
                f"MFU {result['mean_mfu']:.1%}"]


def eval_suite(cfg: Any, kind: str, options: Any = lambda i: {}, *,
               sources: list | None = None, **suite: Any) -> Any:
    """A suite with one task of `kind` per `data.eval` source of a recipe config (or per one of
    `sources`; None without any), rows read and tokenized as prepare did: the config's
    tokenizer, columns, length limit and bad-row policy; `options(i)` adds task i's own
    options; the config's `eval.tasks` (benchmarks, any suite task) follow them."""
    from posttrain.config.eval import SuiteConfig, TaskConfig
    sources = cfg.data.eval if sources is None else sources
    if not sources:
        return None
    tasks = tuple(TaskConfig(name=src.name or f"eval{i}", kind=kind, data=src,
                             max_samples=cfg.eval.max_samples,
                             max_tokens_per_sample=cfg.data.max_tokens_per_sample,
                             columns=cfg.data.columns, on_bad_row=cfg.data.on_bad_row,
                             role_map=cfg.data.role_map, **options(i))
                  for i, src in enumerate(sources))
    extra = tuple(getattr(cfg.eval, "tasks", ()))
    return SuiteConfig(tasks=tasks + extra, tokenizer=cfg.tokenizer, dtype=cfg.model.dtype,
                       **suite)


def policy_flops(model: nn.Module, batch: dict, *, lora: Any = None, training: bool = True,
                 head: bool = True) -> float:
    """Matmul FLOPs of `model` over a batch's real tokens (padding excluded, attention per
    document), plus its LM head over the labelled positions (`head`). A transformers model
    without a native definition is estimated at 6 N (2 N forward) per real token."""
    from posttrain.models.flops import flops_per_token
    args = getattr(model, "args", None)
    if args is None:
        from posttrain.models.fallback import estimated_flops_per_token
        per_token = estimated_flops_per_token(model) / (1 if training else 3)
        return per_token * int(batch["num_real_tokens"])
    kw = {"lora_rank": lora.rank, "lora_targets": tuple(lora.targets)} if lora else {}
    total = 0.0
    for lengths, pad in zip(batch["document_lengths"], batch["row_num_pad"]):
        docs = list(lengths[:-1]) if pad else list(lengths)
        if docs:
            total += sum(docs) * flops_per_token(args, sum(docs), training=training,
                                                 document_lengths=docs, include_head=False,
                                                 **kw)
    if head:
        total += head_flops(args, int(batch["num_loss_tokens"]), training=training,
                            frozen=lora is not None)
    return total


def head_flops(args: Any, positions: int, *, training: bool = True, frozen: bool = False
               ) -> float:
    """The LM head's matmul FLOPs over `positions` labelled positions: forward, and in training
    the input gradient and (unless `frozen`) the weight gradient. The chunked ops project onto
    the real vocabulary rows only (`posttrain.ops.cross_entropy`), so padding rows cost none;
    their recomputation of each chunk's logits in backward is not model work and not counted."""
    fwd = 2.0 * args.hidden_size * args.vocab_size * positions
    return fwd * (1 + (0 if not training else 1 + (0 if frozen else 1)))


# --------------------------------------------------------------------------- the rank worker


class RecipeWorker:
    """One rank of a recipe's run: an `Engine`, a view of the global data stream, the recipe.

    Called by the driver on every rank (the methods are collectives under FSDP). The caller's
    process joins the process group and seeds the global RNG here, not in the Engine.
    `host_budget` is the rank's planned peak, which its CPU heap may keep resident
    (`posttrain.train.host_heap.HostHeap`; None: it releases at every point).
    """

    def __init__(self, recipe_cls: type[Recipe], cfg: dict[str, Any], hf_dir: str,
                 prepared_dir: str, run_dir: str, models: dict[str, str] | None = None,
                 host_budget: int | None = None):
        # here, not at import: the driver and the evaluation import the recipes, not the engine
        from posttrain.distributed.env import init_process_group
        from posttrain.train.engine import Engine
        self.cfg = build(recipe_cls.config_cls, cfg, where=f"{recipe_cls.name} config")
        self.prepared_uri, self.prepared_dir = prepared_dir, local_view(prepared_dir)
        self.run_dir, self.models = run_dir, dict(models or {})
        self.recipe = recipe_cls(self)
        engine_cfg = self.cfg.train.engine
        init_process_group()
        torch.manual_seed(engine_cfg.seed)          # LoRA dropout; checkpointed with the run
        self.engine = Engine(self.cfg.model, engine_cfg, hf_dir, run_dir,
                             loss_factory=self.recipe.loss_root,
                             vocab_size=tokenizer_vocab(prepared_dir),
                             added_tokens=tokenizer_added_ids(prepared_dir),
                             host_budget=host_budget)
        self.rank, self.world = self.engine.rank, self.engine.world
        if self.engine.args is None and not recipe_cls.transformers_fallback:
            raise ConfigError(f"the {recipe_cls.name} recipe needs a model with a native "
                              f"definition; {hf_dir} trains through transformers (SFT, DPO, "
                              "GRPO, distillation and reward models do)")
        self.recipe.ready()
        self.loader = self.recipe.train_loader()
        self._batches = None
        self.tokens_seen = self.units_seen = 0
        self.peak_flops, self.peak_source = device_peak_flops(self.engine.device)

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"rank": self.rank, "world_size": self.world, "params": e.num_params,
                "trainable_params": e.num_trainable, "device": str(e.device),
                "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
                "micro_batches_per_step": self.cfg.train.micro_batches_per_step,
                **self.recipe.describe()}

    def before_training(self) -> dict[str, Any]:
        return self.recipe.before_training()

    def resume(self) -> int:
        """Load the newest valid checkpoint if any; returns the step to continue from."""
        extra = self.engine.load_checkpoint()
        if extra is not None:
            self.loader.load_state_dict(extra["loader"])
            self.tokens_seen = int(extra.get("tokens_seen", 0))
            self.units_seen = int(extra.get("units_seen", 0))
            self.recipe.load_state_dict(extra.get("recipe") or {})
        return self.engine.step

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; None when the data is exhausted before a full step.

        With one stream every rank reads the step's G micro-batches and trains on its share;
        with S streams it reads only its share, G / D, and the counts the loss is normalized
        by are summed over the data-parallel ranks.
        """
        if self._batches is None:
            self._batches = iter(self.loader)
        t0 = time.perf_counter()
        dp, recipe = self.engine.dp, self.recipe
        per_rank = self.cfg.train.loader.streams > 1
        g = self.cfg.train.micro_batches_per_step // (dp.size if per_rank else 1)
        batches = [b for _, b in zip(range(g), self._batches)]
        full = len(batches) == g
        if not (dp.all(full) if per_rank else full):
            return None
        data_s = time.perf_counter() - t0
        counts = {**batch_counts(batches), "flops": sum(recipe.flops(b) for b in batches),
                  "units": float(sum(int(b[recipe.unit_field]) for b in batches))}
        if per_rank:
            counts = dp.sum_all(counts)
        mine = batches if per_rank else dp.share(batches)
        units = int(counts["units"])
        metrics = recipe.train_metrics(
            self.engine.train_step([recipe.inputs(b, "train") for b in mine], units))
        seconds = time.perf_counter() - t0
        metrics.update(step_metrics(counts, seconds=seconds, data_wait_s=data_s,
                                    flops=counts["flops"],
                                    peak_flops=self.peak_flops * self.world,
                                    device=self.engine.device))
        self.tokens_seen += metrics["real_tokens"]
        self.units_seen += units
        metrics["tokens_seen"] = self.tokens_seen
        if recipe.unit_name != "tokens":
            metrics.update({recipe.unit_name: units, f"{recipe.unit_name}_seen": self.units_seen,
                            f"{recipe.unit_name}_per_s": units / seconds})
        return metrics

    def save_checkpoint(self) -> str:
        loader = self.loader.state_dict()
        if "streams" in loader:          # every stream's position, from the ranks that own them
            parts = self.engine.dp.gather(loader["streams"])
            loader = {"streams": {s: st for part in parts for s, st in part.items()}}
        return self.engine.save_checkpoint({"loader": loader, "tokens_seen": self.tokens_seen,
                                            "units_seen": self.units_seen,
                                            "recipe": self.recipe.state_dict()})

    def evaluate(self) -> dict[str, float]:
        """The recipe's held-out metrics: means over the eval units of the loss root's sums."""
        batches = self.recipe.eval_batches()
        if not batches:
            return {}
        units = sum(int(b[self.recipe.unit_field]) for b in batches)
        out = self.recipe.eval_metrics(self.eval_sums(batches, "eval"), units)
        return {**out, f"eval_{self.recipe.unit_name}": units, "eval_batches": len(batches)}

    def eval_sums(self, batches: list[dict], split: str) -> dict[str, float]:
        """The loss root's sums over `batches`, without gradients, each counted once.

        Batches are split over the data-parallel ranks; under FSDP every rank must run the same
        number of forwards (the all-gathers are collective), so a rank with one batch fewer
        repeats its first batch without counting it.
        """
        dp, recipe = self.engine.dp, self.recipe
        mine = dp.share(batches)
        sums: dict[str, float] = {}
        for b in mine:
            for k, v in self.engine.eval_sums(recipe.inputs(b, split)).items():
                sums[k] = sums.get(k, 0.0) + v
        for _ in range(dp.rounds(len(batches)) - len(mine)):
            padding = self.engine.eval_sums(recipe.inputs(batches[0], split))
            # a rank without a batch of its own (more ranks than batches) still needs the keys
            for k in padding:
                sums.setdefault(k, 0.0)
        return dp.sum_all(sums)

    def export(self, out_dir: str) -> str | None:
        return self.recipe.export(out_dir)

    def close(self) -> None:
        self.loader.close()
