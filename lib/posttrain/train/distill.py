"""The distillation recipe's parts: config schema, the teacher check, the loss root, the worker.

A student learns a frozen teacher's next-token distribution on SFT chat rows
(`posttrain.losses.distill`: forward KL, reverse KL or generalized JSD at a temperature,
optionally mixed with cross-entropy on the labels). The teacher signal is either

- online: the teacher runs on the same workers. It sits inside the FSDP root beside the
  student (`DistillLoss`), its blocks sharded with FSDP2 like the student's
  (`shard_frozen`), its embedding and head in the root's group, so its head weight is
  gathered during the root forward, where the chunked loss reads it. It has no gradients and
  no optimizer state, and checkpoints leave it out (frozen parameters are rebuilt from
  `teacher.hf_dir` or the seeded init before a resume loads; `posttrain.train.checkpoint`).
- offline: `steps/teacher_topk.py` stored the teacher's top-k log-probs per label position
  beside the prepared shards; the worker reads those rows with `posttrain.data.topk.TopkLoader`
  (its own loader: the packed batches carry the top-k as extra tensors) and no teacher is
  built.

The data rule, steps, checkpoints and export are the recipe kernel's
(`posttrain.train.recipe`): every rank reads the same global stream of micro-batches and trains
on its share.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from posttrain.config.recipes import DataConfig
from posttrain.data.tokenizer import TokenizerConfig
from posttrain.errors import ConfigError
from posttrain.losses.distill import KINDS, distill_loss
from posttrain.models.transformer import Transformer
from posttrain.train.engine import ModelConfig, ModelInitConfig
from posttrain.train.recipe import (ExportConfig, Recipe, RunConfig, TrainConfig, check_export,
                                    check_context_parallel, check_step_split, eval_suite, policy_flops,
                                    check_eval_tasks)
from posttrain.train.sft import EvalConfig

log = logging.getLogger(__name__)

TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_logps")


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher: an HF checkpoint directory (or a random one, for tests and the tiny run)."""

    hf_dir: str | None = None
    init: ModelInitConfig | None = None
    signal: Literal["online", "offline"] = "online"
    topk: int = 32                  # offline: teacher log-probs stored per label position

    def __post_init__(self) -> None:
        if (self.hf_dir is None) == (self.init is None):
            raise ValueError("teacher: set exactly one of hf_dir (a checkpoint) or init "
                             "(a random model from a config)")
        if self.topk < 1:
            raise ValueError(f"teacher.topk must be at least 1, got {self.topk}")


@dataclass(frozen=True)
class DistillLossConfig:
    kind: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5               # jsd mixture weight on the teacher
    temperature: float = 1.0
    ce_weight: float = 0.0          # loss = (1 - ce_weight) T^2 D + ce_weight CE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"loss.beta must be in (0, 1) for kind jsd, got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"loss.ce_weight must be in [0, 1], got {self.ce_weight}")


@dataclass(frozen=True)
class DistillConfig:
    tokenizer: TokenizerConfig
    data: DataConfig
    model: ModelConfig              # the student
    teacher: TeacherConfig
    train: TrainConfig
    loss: DistillLossConfig = DistillLossConfig()
    run: RunConfig = RunConfig(dir="runs/distill")
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self) -> None:
        if self.data.format not in ("chat", "sequence"):
            raise ValueError(f"distillation trains on chat or sequence data, not "
                             f"{self.data.format!r}")
        check_export(self.export, self.model.lora)
        check_eval_tasks(self.data.eval, self.eval.tasks)
        if self.teacher.signal == "offline":
            loader = self.train.loader
            if loader.weights:
                raise ValueError("train.loader.weights: the offline teacher's top-k rows are "
                                 "read as one stream over all train sources; remove the weights "
                                 "or use teacher.signal: online")
            if loader.mode != "packed":
                raise ValueError("train.loader.mode: the offline teacher's loader packs rows; "
                                 "use mode: packed")
            if loader.streams != 1:
                raise ValueError("train.loader.streams: the offline teacher's top-k rows are "
                                 "read as one stream; use streams: 1 or teacher.signal: online")
        check_step_split(self.train.micro_batches_per_step, self.run, self.train.engine.parallel,
                         self.train.loader.streams)
        check_context_parallel("distill", self.train.engine.parallel, self.train.loader)


# --------------------------------------------------------------------------- teacher check

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def check_teacher(teacher_dir: str, student_dir: str, tokenizer_dir: str) -> None:
    """Refuse a teacher that does not share the student's tokenizer (ConfigError).

    Compares the teacher directory's tokenizer (its vocabulary, added tokens included) with the
    prepared tokenizer the data was tokenized with, and the `vocab_size` of the teacher's and
    the student's configs: token id i must mean the same string to both models, or the
    per-token distributions compared by the loss are about different things.
    """
    teacher, tokenizer = Path(teacher_dir), Path(tokenizer_dir)
    if not any((teacher / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(f"teacher {teacher_dir}: no tokenizer files "
                          f"({', '.join(_TOKENIZER_FILES)}); the teacher directory must hold its "
                          f"tokenizer so that it can be checked against the data's "
                          f"({tokenizer_dir})")
    from transformers import AutoTokenizer
    t_vocab = AutoTokenizer.from_pretrained(str(teacher)).get_vocab()
    d_vocab = AutoTokenizer.from_pretrained(str(tokenizer)).get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:5]
        raise ConfigError(
            f"teacher {teacher_dir}: its tokenizer differs from the one the data was prepared "
            f"with ({tokenizer_dir}): {len(t_vocab)} vs {len(d_vocab)} tokens, e.g. "
            f"{[f'{tok!r}={i}' for tok, i in differ]}; distillation needs a teacher and student "
            f"that share the tokenizer")
    t_size = _config_vocab(teacher_dir)
    s_size = _config_vocab(student_dir)
    if t_size != s_size:
        raise ConfigError(f"teacher {teacher_dir}: config vocab_size {t_size} differs from the "
                          f"student's {s_size} ({student_dir}); distillation compares their "
                          f"distributions over the same vocabulary")
    if len(d_vocab) > t_size:
        raise ConfigError(f"teacher {teacher_dir}: the tokenizer has {len(d_vocab)} tokens but "
                          f"the teacher's vocab_size is {t_size}; added tokens the teacher has "
                          f"never seen cannot be distilled")


def _config_vocab(hf_dir: str) -> int:
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config["vocab_size"])


# --------------------------------------------------------------------------- the loss root


class DistillLoss(nn.Module):
    """The FSDP root of a distillation run: student forward, teacher forward, chunked loss.

    `teacher` is None for an offline teacher; then the batch carries `teacher_topk_ids` and
    `teacher_topk_logps` [B, T, K] aligned with `labels`. Returns the loss summed over the
    labelled positions and the divergence (and CE) sums as stats.
    """

    def __init__(self, model: Transformer, teacher: Transformer | None, cfg: DistillLossConfig,
                 chunk_tokens: int = 1024):
        super().__init__()
        self.model = model
        self.teacher = teacher
        self.cfg = cfg
        self.chunk_tokens = chunk_tokens
        keys = ("input_ids", "labels", "position_ids", "document_lengths")
        self.input_keys = keys if teacher is not None else keys + TOPK_KEYS
        for m in (model, teacher):
            if m is not None and getattr(m.head, "softcap", None) is not None:
                name = m.args.family if getattr(m, "args", None) is not None else m.model_type
                raise ConfigError(f"{name}: final-logit softcapping is not supported by the "
                                  "distillation loss")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                document_lengths: list[list[int]] | None = None,
                teacher_topk_ids: torch.Tensor | None = None,
                teacher_topk_logps: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden = self.model(input_ids, position_ids, document_lengths)
        head, c = self.model.head, self.cfg
        teacher_hidden = teacher_weight = topk = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher_hidden = self.teacher(input_ids, position_ids, document_lengths)
            teacher_weight = self.teacher.head.weight
        else:
            topk = (teacher_topk_ids, teacher_topk_logps)
        loss, metrics = distill_loss(
            hidden, head.weight, teacher_hidden, teacher_weight, labels, kind=c.kind,
            beta=c.beta, temperature=c.temperature, ce_weight=c.ce_weight,
            real_vocab_size=head.real_vocab_size, chunk_tokens=self.chunk_tokens,
            teacher_topk=topk, reduction="sum")
        stats = {"divergence": metrics["divergence"] * metrics["tokens"]}
        if "ce" in metrics:
            stats["ce"] = metrics["ce"] * metrics["tokens"]
        return loss, stats


# --------------------------------------------------------------------------- the worker


class Distill(Recipe):
    """Knowledge distillation: the student is the engine's model; an online teacher sits in the
    same FSDP root (`DistillLoss`), frozen; an offline teacher's top-k come with the batches.
    The driver hands the teacher's directory in the worker's ``models["teacher"]``.

    Either model may lack a native definition (`posttrain.models.fallback`): the student then
    trains through transformers (the engine's fallback), and such a teacher is loaded whole
    through transformers, its blocks sharded like a native teacher's; its tensors are kept on
    the CPU until `ready` writes them back, since the root's materialization gives every
    parameter and buffer new storage."""

    name = "distill"
    config_cls = DistillConfig

    def __init__(self, worker: Any):
        super().__init__(worker)
        self.teacher: nn.Module | None = None
        self._teacher_tensors: dict[str, dict[str, torch.Tensor]] | None = None

    def loss_root(self, model: Transformer) -> nn.Module:
        if self.cfg.teacher.signal == "online":
            from posttrain.distributed.env import build_mesh
            from posttrain.distributed.parallelize import shard_frozen
            from posttrain.models.auto import has_native_definition
            from posttrain.models.hf_io import load_hf, read_hf_config
            teacher_dir = self.worker.models["teacher"]
            if has_native_definition(read_hf_config(teacher_dir)):
                self.teacher = load_hf(teacher_dir, on_meta=True,
                                       param_filter=lambda name: False,
                                       vocab_multiple=self.cfg.model.vocab_multiple)
            else:
                self.teacher, self._teacher_tensors = self._fallback_teacher(teacher_dir)
            parallel = self.cfg.train.engine.parallel
            shard_frozen(self.teacher, build_mesh(parallel.dp_shard, parallel.tp,
                                                  parallel.dp_replicate, parallel.cp), parallel)
        return DistillLoss(model, self.teacher, self.cfg.loss, self.cfg.model.loss_chunk_tokens)

    def _fallback_teacher(self, teacher_dir: str
                          ) -> tuple[nn.Module, dict[str, dict[str, torch.Tensor]]]:
        """A teacher without a native definition, loaded through transformers (rank 0 warns,
        naming it), and its parameters (every tied name) and buffers for `ready`."""
        import warnings

        import torch.distributed as dist

        from posttrain.distributed.materialize import parameters_by_name
        from posttrain.models.args import DTYPES
        from posttrain.models.fallback import FallbackWarning, load_fallback
        with warnings.catch_warnings():
            if dist.get_rank() != 0:
                warnings.simplefilter("ignore", FallbackWarning)
            teacher = load_fallback(teacher_dir, dtype=DTYPES[self.cfg.model.dtype],
                                    vocab_multiple=self.cfg.model.vocab_multiple)
        tensors = {"parameters": {n: p.detach() for n, p in parameters_by_name(teacher).items()},
                   "buffers": {n: b.detach() for n, b in teacher.named_buffers()}}
        return teacher, tensors

    def ready(self) -> None:
        """Write the teacher's tensors into its shards (the root is already on the device): a
        native teacher's streamed from its HF files, a transformers one's kept at load."""
        if self.teacher is None:
            return
        from posttrain.distributed.materialize import fill_parameters
        root = self.worker.engine.root
        if self._teacher_tensors is not None:
            fill_parameters(root, self._teacher_tensors["parameters"].items(),
                            prefix="teacher.")
            with torch.no_grad():
                for name, buffer in self.teacher.named_buffers():
                    buffer.copy_(self._teacher_tensors["buffers"][name])
            self._teacher_tensors = None
            return
        from posttrain.models.args import DTYPES
        from posttrain.models.hf_io import iter_hf_tensors
        dtype = DTYPES[self.cfg.model.dtype]
        tensors = iter_hf_tensors(self.worker.models["teacher"], self.teacher.args)
        fill_parameters(root, ((n, t.to(dtype)) for n, t in tensors), prefix="teacher.")
        self.teacher.tie_weights()

    def train_loader(self) -> Any:
        if self.teacher is not None:
            return super().train_loader()
        from posttrain.data.topk import TopkLoader, topk_files
        return TopkLoader(topk_files(self.worker.prepared_uri), self.cfg.train.loader)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"teacher_signal": self.cfg.teacher.signal}
        if self.teacher is not None:
            from posttrain.distributed.parallelize import count_params
            info["teacher_params"] = count_params(self.teacher)
        return info

    def flops(self, batch: dict) -> float:
        """The student's forward and backward, plus the online teacher's forward over the real
        tokens and its head over the labelled positions."""
        total = super().flops(batch)
        if self.teacher is not None:
            total += policy_flops(self.teacher, batch, training=False)
        return total

    def eval_batches(self) -> list[dict]:
        """Held-out batches with the online teacher; the offline run has no held-out top-k and
        leaves the held-out numbers to the evaluate step, which runs the teacher."""
        return super().eval_batches() if self.teacher is not None else []

    @staticmethod
    def eval_suite(cfg: DistillConfig, models: dict[str, str]) -> Any:
        """Held-out KL(teacher || student) and loss, the export against the starting student."""
        return eval_suite(cfg, "distill", lambda i: {"format": cfg.data.format,
                                                     "teacher": models["teacher"]})

    @staticmethod
    def summary(result: dict) -> list[str]:
        ev = result.get("eval") or {}
        return Recipe.summary(result) + ([
            f"held-out distillation loss {ev['eval_loss']:.4f} over {ev['eval_tokens']} "
            "tokens"] if ev else [])
