"""The TRL side of the posttrain-vs-TRL bench (`bench/vs_trl.py`): one measurement per process.

Runs in the TRL environment (``make trl-env`` -> ``.venv-trl``), never imports posttrain:

    .venv-trl/bin/python bench/trl_peer.py --recipe sft --mode packing --model DIR --tokenizer DIR \
        --data chat.jsonl --max-length 2048 --batch-size 8 --warmup-steps 1 --steps 4 --threads 2

Each run prints exactly one JSON line on stdout (everything else, TRL's and transformers' logs
included, goes to stderr: file descriptor 1 is pointed at stderr for the whole run). Every line
carries ``recipe``, ``trl_version``, ``transformers_version``, ``torch_version``,
``torch_threads``, ``omp_num_threads``, ``attn_implementation``, ``dtype`` and ``peak_rss_bytes``
(``ru_maxrss`` * 1024 of this process, read right after the timed work).

Inputs (JSONL, one object a line; other keys are dropped):

* ``sft`` / ``prepare``: ``{"messages": [{"role", "content"}, ...]}`` (conversational language
  modeling).
* ``dpo``: ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant
  messages]}`` (TRL's conversational preference format with an explicit prompt).
* ``grpo``: ``{"prompt": [messages]}`` (conversational prompt-only).

``--model`` is a transformers causal-LM checkpoint directory (loaded in fp32 before any timer),
``--tokenizer`` a tokenizer directory with a chat template (AutoTokenizer).

Recipes and what they report:

* ``sft --mode {packing,padding_free,group_by_length,padded}``: `SFTTrainer`, batch
  ``--batch-size`` rows per optimizer step (no accumulation), ``--warmup-steps`` untimed steps,
  then ``--steps`` timed ones. ``packing``: ``packing=True`` with TRL's default BFD strategy,
  rows packed up to ``--max-length``; TRL turns padding-free on for BFD, so the whole batch is
  flattened into ONE sequence of up to batch*max_length tokens. ``padding_free``:
  ``padding_free=True`` without packing; TRL refuses a ``max_length`` there (it would not be
  enforced), so max_length is None (``max_length_enforced: false``, ``max_row_tokens`` says how
  long the longest row is). ``group_by_length``: transformers 5 dropped the ``group_by_length``
  flag; its replacement ``train_sampling_strategy="group_by_length"`` (LengthGroupedSampler,
  which puts the batch with the longest row first, i.e. into the warm-up) is used, with padding
  to the longest row of each batch. ``padded``: random batches padded to their longest row.
  Reports ``real_tokens_per_s`` (non-padding tokens of the timed steps / ``seconds``),
  ``real_tokens``, ``padded_tokens`` (tensor elements fed), ``loss_tokens`` (labels != -100),
  ``seconds`` (sum over timed steps of on_step_begin -> on_step_end: forward, backward,
  clipping, optimizer), ``wall_seconds`` (end of the warm-up to the end of the last timed step:
  also the batch fetch + collation, which transformers runs before on_step_begin, and logging),
  ``real_tokens_per_s_wall``, ``step_seconds``, ``losses`` (one per timed step),
  ``warmup_losses``, ``tokenize_seconds`` (TRL's `_prepare_dataset`: chat template, tokenization,
  assistant masks, labels, packing), ``constructor_seconds`` (the whole `SFTTrainer(...)`), and
  ``loss_masking``.
* ``prepare --mode {packing,padding_free,group_by_length,padded}``: only the dataset preparation
  `SFTTrainer` does (the model is loaded before the timer): ``seconds`` (`_prepare_dataset`),
  ``constructor_seconds``, ``load_seconds`` (JSONL parse + `Dataset.from_list`, untimed in
  ``seconds``), ``rows``, ``tokens`` (sum of prepared ``input_ids`` lengths), ``loss_tokens``,
  ``out_rows`` (packed rows for packing). ``dataset_num_proc`` is TRL's default (None: one
  process).
* ``dpo``: `DPOTrainer`, reference model = TRL's default (``ref_model=None``: a second copy of
  the checkpoint, its forward run inside each step), beta 0.1, sigmoid loss. Reports
  ``pairs_per_s`` (pairs of the timed steps / ``seconds``), ``pairs``, ``seconds``,
  ``wall_seconds``, ``real_tokens`` (chosen+rejected, non-padding), ``real_tokens_per_s``,
  ``losses``, ``tokenize_seconds``. With ``--precompute-ref``: ``precompute_ref_log_probs=True``
  (TRL computes the reference log-probs of the whole dataset in the constructor and keeps no
  reference model); ``ref_precompute_seconds`` and ``ref_precompute_pairs`` are reported and
  ``pairs_per_s_amortized`` charges each trained pair its share of the precompute.
* ``grpo``: `GRPOTrainer`, generation with transformers ``generate`` (no vLLM; with
  ``--continuous-batching`` transformers' continuous-batching engine instead), one generation
  of ``--prompts-per-step`` x ``--completions`` completions per optimizer step
  (``per_device_train_batch_size = P*K``, ``num_generations = K``, no accumulation, so
  ``steps_per_generation = 1``, ``num_iterations = 1`` and TRL skips the old-log-prob pass),
  ``max_completion_length = --max-new-tokens``, temperature 1.0, beta 0.0 (no reference model),
  TRL's default ``loss_type`` (reported), reward = -|completion tokens - 16| (pure Python).
  Reports ``seconds_per_step`` (median over the timed steps), ``generation_seconds_per_step``
  (inside ``generate``), ``score_seconds_per_step`` (the rest of TRL's
  `_generate_and_score_completions`: tokenizing prompts, decoding, rewards, advantages),
  ``update_seconds_per_step`` (step minus `_generate_and_score_completions`: the policy
  forward/backward and the optimizer step), ``generated_tokens`` (per step, median),
  ``generation_tokens_per_s`` and ``update_tokens_per_s`` (prompt+completion tokens of the
  update / update seconds), all from the timed steps. ``--continuous-batching`` exists to show
  TRL's other non-vLLM generator; on CPU it was ~40x slower than ``generate`` at 4 x 4 x 32 and
  held ~12 GB (its KV-cache pool), so ``generate`` is TRL's best here.

Choices (TRL defaults elsewhere; we compare against TRL's best mode, so nothing is crippled):
fp32 (``bf16=False``: TRL's configs default bf16 to True), ``activation_checkpointing=False``
(transformers 5.24's name for ``gradient_checkpointing``, which TRL's configs default to True, ~20%
slower), ``use_liger_kernel=False`` (Triton, no CPU),
``use_cpu=True``, TRL's fused LM head (log-probs in chunks, no full logits) as TRL installs it,
transformers' default optimizer (``adamw_torch_fused``), a constant learning rate (``--lr``;
SFT 1e-3, DPO/GRPO TRL's 1e-6), ``report_to="none"``, no evaluation, no saving,
``dataloader_num_workers=0``, ``--attn-implementation sdpa``. On CPU there is no FlashAttention:
packing and padding-free give the model one flattened sequence plus ``position_ids`` and no
attention mask, and transformers then builds a dense block-diagonal mask over the whole
flattened sequence (``find_packed_sequence_indices``), so attention costs (total tokens of the
batch)^2 rather than the sum of squares of the documents: ``packing`` with ``--batch-size 8`` and
``--max-length 2048`` trains one ~16k-token sequence per step (about 70 s and 6 GB for 14k tokens
of a 4.8 M-parameter model on one thread), so TRL's best packing on CPU is ``--batch-size 1``.
FlexAttention (``--attn-implementation flex_attention``), which could skip the masked blocks, has
no backward on CPU in torch 2.13.

Loss masking (SFT): ``assistant_only_loss=True``. TRL needs ``{% generation %}`` markers in the
chat template; when the tokenizer's template has none, TRL swaps in its own training template
for the families it knows (Qwen, Llama, Gemma, ...). For the repository's ChatML template (which
TRL does not know), this script installs the same template with markers around each assistant
message's content and its ``<|im_end|>`` (the tokens posttrain trains: not the role header, not
the newline after ``<|im_end|>``) after checking that it renders the data identically. With any
other unmarked template it falls back to prompt-completion rows (all messages but the last as
the prompt, the last assistant message as the completion, TRL's completion-only loss).
``loss_masking`` in the JSON says which one ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

RECIPES = ("sft", "prepare", "dpo", "grpo")
SFT_MODES = ("packing", "padding_free", "group_by_length", "padded")
TARGET_LENGTH = 16  # GRPO reward: -|completion tokens - 16|

# The repository's ChatML template (tools/make_assets.py CHAT_TEMPLATE) and the same template with
# {% generation %} markers around what an assistant turn generates: its content and <|im_end|>.
REPO_CHATML = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)
REPO_CHATML_TRAINING = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- generation -%}\n"
    "{{- message['content'] + '<|im_end|>' -}}\n"
    "{%- endgeneration -%}\n"
    "{{- '\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


def log(*parts: Any) -> None:
    print("[trl_peer]", *parts, file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_jsonl(path: str, keys: tuple[str, ...], rows: int | None) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in keys if k not in row]
            if missing:
                raise SystemExit(f"{path}: row {len(out) + 1} lacks {missing}")
            out.append({k: row[k] for k in keys})
            if rows is not None and len(out) >= rows:
                break
    return out


# ------------------------------------------------------------------ shared pieces


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(a: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                attn_implementation=a.attn_implementation)


def common_args(a: argparse.Namespace, out_dir: str, lr: float) -> dict[str, Any]:
    """TrainingArguments shared by every recipe (see the module docstring)."""
    return dict(output_dir=out_dir, max_steps=a.warmup_steps + a.steps,
                gradient_accumulation_steps=1, learning_rate=lr, lr_scheduler_type="constant",
                warmup_steps=0, bf16=False, fp16=False, activation_checkpointing=False,
                use_liger_kernel=False, use_cpu=True, report_to="none", save_strategy="no",
                eval_strategy="no", logging_steps=1, disable_tqdm=True,
                dataloader_num_workers=0, seed=a.seed, data_seed=a.seed)


def make_step_timer(warmup: int, total: int):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """on_step_begin / on_step_end timestamps of every optimizer step; the peak RSS is read
        at the end of the last step."""

        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []
            self.rss = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())
            if len(self.end) == total:
                self.rss = peak_rss_bytes()

        def timed(self) -> tuple[list[float], float]:
            """Per-step seconds of the timed steps, and their wall-clock span (from the end of
            the last warm-up step, or the start of the first step without warm-up)."""
            if len(self.end) < total:
                raise RuntimeError(f"only {len(self.end)} of {total} steps ran (data too short?)")
            steps = [e - b for b, e in zip(self.begin[warmup:total], self.end[warmup:total])]
            start = self.end[warmup - 1] if warmup > 0 else self.begin[0]
            return steps, self.end[total - 1] - start

    return StepTimer()


def wrap_training_step(trainer, per_step: list[dict], stats) -> None:
    """Record `stats(inputs)` and the loss of every micro-batch (= optimizer step here)."""
    orig = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        rec = stats(inputs)
        loss = orig(model, inputs, num_items_in_batch)
        rec["loss"] = float(loss.detach().float())
        per_step.append(rec)
        return loss

    trainer.training_step = training_step


class TimedMethod:
    """Wrap `obj.name` (class or instance attribute) to record each call's seconds."""

    def __init__(self, obj: Any, name: str, on_result=None):
        self.calls: list[float] = []
        self.results: list[Any] = []
        orig = getattr(obj, name)  # a bound method (instance) or a plain function (class)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            self.calls.append(time.perf_counter() - t0)
            if on_result is not None:
                self.results.append(on_result(out))
            return out

        setattr(obj, name, timed)


def describe(args) -> dict[str, Any]:
    """The training arguments that matter for speed, as the trainer resolved them."""
    optim = getattr(args.optim, "value", args.optim)
    return dict(optim=str(optim), learning_rate=args.learning_rate, bf16=bool(args.bf16),
                activation_checkpointing=bool(args.activation_checkpointing),
                use_liger_kernel=bool(args.use_liger_kernel),
                torch_compile=bool(args.torch_compile))


def rows_tokens(dataset) -> tuple[int, int, int]:
    """(rows, tokens, loss tokens) of a prepared SFT dataset."""
    ids = dataset["input_ids"]
    tokens = sum(len(x) for x in ids)
    loss = 0
    if "labels" in dataset.column_names:
        loss = sum(sum(1 for t in lab if t != -100) for lab in dataset["labels"])
    return len(ids), tokens, loss


# ------------------------------------------------------------------ SFT and prepare


def sft_loss_masking(tok, rows: list[dict]) -> tuple[list[dict], dict[str, Any], str]:
    """Rows, SFTConfig kwargs and a description of the loss masking (module docstring)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    if has_generation_markers(tok.chat_template):
        return rows, {"assistant_only_loss": True}, \
            "assistant_only_loss (the tokenizer's template has generation markers)"
    try:
        if get_training_chat_template(tok) is not None:
            return rows, {"assistant_only_loss": True}, \
                "assistant_only_loss (TRL's training template for this model family)"
    except ValueError:
        pass
    if tok.chat_template.strip() == REPO_CHATML.strip():
        for row in rows[:256]:
            plain = tok.apply_chat_template(row["messages"], tokenize=False)
            marked = tok.apply_chat_template(row["messages"], tokenize=False,
                                             chat_template=REPO_CHATML_TRAINING)
            if plain != marked:
                raise SystemExit("the marked ChatML template renders differently: "
                                 f"{plain[:200]!r} vs {marked[:200]!r}")
        tok.chat_template = REPO_CHATML_TRAINING
        return rows, {"assistant_only_loss": True}, (
            "assistant_only_loss (the repo's ChatML template with {% generation %} markers "
            "around assistant content + <|im_end|>, render-identical)")
    out = []
    for row in rows:
        msgs = row["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            continue
        out.append({"prompt": msgs[:-1], "completion": msgs[-1:]})
    return out, {"completion_only_loss": True}, (
        "completion_only_loss (prompt-completion rows: last assistant message trained; the "
        "template has no generation markers and TRL has no training template for it)")


def sft_config(a: argparse.Namespace, out_dir: str, extra: dict[str, Any]):
    from trl import SFTConfig
    mode = a.mode
    kw = common_args(a, out_dir, a.lr if a.lr is not None else 1e-3)
    kw.update(per_device_train_batch_size=a.batch_size, max_length=a.max_length,
              packing=mode == "packing", packing_strategy="bfd",
              padding_free=mode == "padding_free",
              train_sampling_strategy="group_by_length" if mode == "group_by_length"
              else "random", **extra)
    if mode == "padding_free":
        kw["max_length"] = None  # TRL: "When padding_free=True without packing, max_length is
        #                          not enforced" -> it raises unless max_length is None
    return SFTConfig(**kw)


def build_sft(a: argparse.Namespace, out_dir: str, callbacks=()):
    """Load everything, then time TRL's dataset preparation inside the SFTTrainer constructor."""
    from datasets import Dataset
    from trl import SFTTrainer

    model = load_model(a)
    tok = load_tokenizer(a.tokenizer)
    t0 = time.perf_counter()
    rows = read_jsonl(a.data, ("messages",), a.rows)
    rows, extra, masking = sft_loss_masking(tok, rows)
    dataset = Dataset.from_list(rows)
    load_seconds = time.perf_counter() - t0
    args = sft_config(a, out_dir, extra)
    prep = TimedMethod(SFTTrainer, "_prepare_dataset")
    t0 = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                         callbacks=list(callbacks))
    constructor_seconds = time.perf_counter() - t0
    info = dict(loss_masking=masking, rows=len(rows), load_seconds=load_seconds,
                tokenize_seconds=sum(prep.calls), constructor_seconds=constructor_seconds,
                max_length_enforced=args.max_length is not None, packing=args.packing,
                packing_strategy=args.packing_strategy if args.packing else None,
                padding_free=bool(trainer.padding_free),
                train_sampling_strategy=args.train_sampling_strategy,
                batch_size=a.batch_size, max_length=a.max_length, **describe(args))
    return trainer, info


def sft_batch_stats(inputs) -> dict:
    ids = inputs["input_ids"]
    if "attention_mask" in inputs:
        real = int(inputs["attention_mask"].sum())
    else:
        # padding-free: one flattened row; pad_to_multiple_of is None off Neuron, so no padding
        real = int(ids.numel())
    return dict(real=real, padded=int(ids.numel()), shape=list(ids.shape),
                loss_tokens=int((inputs["labels"] != -100).sum()))


def recipe_sft(a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    total = a.warmup_steps + a.steps
    timer = make_step_timer(a.warmup_steps, total)
    trainer, info = build_sft(a, out_dir, callbacks=[timer])
    n_rows, n_tokens, _ = rows_tokens(trainer.train_dataset)
    max_row = max(len(x) for x in trainer.train_dataset["input_ids"])
    per_step: list[dict] = []
    wrap_training_step(trainer, per_step, sft_batch_stats)
    log(f"sft {a.mode}: {n_rows} prepared rows, {n_tokens} tokens, longest {max_row}; "
        f"training {total} steps")
    trainer.train()
    steps, wall = timer.timed()
    rss = timer.rss
    timed = per_step[a.warmup_steps:total]
    real = sum(s["real"] for s in timed)
    seconds = sum(steps)
    return dict(info, mode=a.mode, steps=a.steps, warmup_steps=a.warmup_steps,
                seconds=seconds, wall_seconds=wall, step_seconds=steps,
                real_tokens=real, padded_tokens=sum(s["padded"] for s in timed),
                loss_tokens=sum(s["loss_tokens"] for s in timed),
                real_tokens_per_s=real / seconds, real_tokens_per_s_wall=real / wall,
                batch_shapes=[s["shape"] for s in timed],
                losses=[s["loss"] for s in timed],
                warmup_losses=[s["loss"] for s in per_step[:a.warmup_steps]],
                prepared_rows=n_rows, prepared_tokens=n_tokens, max_row_tokens=max_row,
                peak_rss_bytes=rss)


def recipe_prepare(a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    trainer, info = build_sft(a, out_dir)
    rss = peak_rss_bytes()
    out_rows, tokens, loss_tokens = rows_tokens(trainer.train_dataset)
    info = dict(info)
    seconds = info.pop("tokenize_seconds")
    return dict(info, mode=a.mode, seconds=seconds, tokens=tokens, loss_tokens=loss_tokens,
                out_rows=out_rows, tokens_per_s=tokens / seconds, peak_rss_bytes=rss)


# ------------------------------------------------------------------ DPO


def recipe_dpo(a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    total = a.warmup_steps + a.steps
    timer = make_step_timer(a.warmup_steps, total)
    model = load_model(a)
    tok = load_tokenizer(a.tokenizer)
    rows = read_jsonl(a.data, ("prompt", "chosen", "rejected"), a.rows)
    dataset = Dataset.from_list(rows)
    kw = common_args(a, out_dir, a.lr if a.lr is not None else 1e-6)
    kw.update(per_device_train_batch_size=a.batch_size, max_length=a.max_length, beta=0.1,
              precompute_ref_log_probs=a.precompute_ref)
    args = DPOConfig(**kw)
    prep = TimedMethod(DPOTrainer, "_prepare_dataset")
    pre = TimedMethod(DPOTrainer, "_precompute_ref_logps", on_result=len)
    t0 = time.perf_counter()
    # ref_model=None: TRL loads a second copy of the checkpoint as the reference (or, with
    # precompute_ref_log_probs, uses the policy itself before training and keeps no reference)
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                         callbacks=[timer])
    constructor_seconds = time.perf_counter() - t0
    per_step: list[dict] = []

    def stats(inputs) -> dict:
        return dict(real=int(inputs["attention_mask"].sum()),
                    padded=int(inputs["input_ids"].numel()),
                    shape=list(inputs["input_ids"].shape),
                    pairs=int(inputs["input_ids"].shape[0]) // 2)

    wrap_training_step(trainer, per_step, stats)
    log(f"dpo: {len(trainer.train_dataset)} pairs, precompute_ref={a.precompute_ref}, "
        f"reference model kept: {trainer.ref_model is not None}; training {total} steps")
    trainer.train()
    steps, wall = timer.timed()
    rss = timer.rss
    timed = per_step[a.warmup_steps:total]
    pairs = sum(s["pairs"] for s in timed)
    real = sum(s["real"] for s in timed)
    seconds = sum(steps)
    out = dict(mode="precompute_ref" if a.precompute_ref else "ref_in_step", steps=a.steps,
               warmup_steps=a.warmup_steps, batch_size=a.batch_size, max_length=a.max_length,
               beta=args.beta, loss_type=list(args.loss_type) if isinstance(
                   args.loss_type, (list, tuple)) else args.loss_type,
               pairs=pairs, seconds=seconds, wall_seconds=wall, step_seconds=steps,
               pairs_per_s=pairs / seconds, pairs_per_s_wall=pairs / wall, real_tokens=real,
               padded_tokens=sum(s["padded"] for s in timed), real_tokens_per_s=real / seconds,
               batch_shapes=[s["shape"] for s in timed], losses=[s["loss"] for s in timed],
               rows=len(rows), tokenize_seconds=sum(prep.calls),
               constructor_seconds=constructor_seconds,
               reference_model_kept=trainer.ref_model is not None, **describe(args),
               peak_rss_bytes=rss)
    if a.precompute_ref:
        pre_s, pre_pairs = sum(pre.calls), sum(pre.results)
        out.update(ref_precompute_seconds=pre_s, ref_precompute_pairs=pre_pairs,
                   pairs_per_s_amortized=pairs / (seconds + pre_s * pairs / pre_pairs))
    return out


# ------------------------------------------------------------------ GRPO


def length_reward(completion_ids, **kwargs) -> list[float]:
    """-|completion tokens - 16|: cheap, pure Python."""
    return [-abs(len(c) - TARGET_LENGTH) for c in completion_ids]


def recipe_grpo(a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    total = a.warmup_steps + a.steps
    timer = make_step_timer(a.warmup_steps, total)
    model = load_model(a)
    tok = load_tokenizer(a.tokenizer)
    rows = read_jsonl(a.data, ("prompt",), a.rows)
    dataset = Dataset.from_list(rows)
    per_step_completions = a.prompts_per_step * a.completions
    kw = common_args(a, out_dir, a.lr if a.lr is not None else 1e-6)
    kw.update(per_device_train_batch_size=per_step_completions, num_generations=a.completions,
              max_completion_length=a.max_new_tokens, temperature=1.0, beta=0.0,
              use_vllm=False, use_transformers_continuous_batching=a.continuous_batching)
    args = GRPOConfig(**kw)
    assert args.steps_per_generation == 1 and args.generation_batch_size == per_step_completions
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                          train_dataset=dataset, processing_class=tok, callbacks=[timer])
    gen = TimedMethod(trainer, "_generate_single_turn",
                      on_result=lambda out: sum(len(c) for c in out[0]))

    def batch_tokens(out) -> dict:
        return dict(prompt=int(out["prompt_mask"].sum()),
                    completion=int(out["completion_mask"].sum()),
                    completions=int(out["completion_ids"].shape[0]))

    score = TimedMethod(trainer, "_generate_and_score_completions", on_result=batch_tokens)
    log(f"grpo: {a.prompts_per_step} prompts x {a.completions} completions x "
        f"{a.max_new_tokens} new tokens, loss_type={args.loss_type}; training {total} steps")
    trainer.train()
    steps, wall = timer.timed()
    rss = timer.rss
    if len(gen.calls) != total or len(score.calls) != total:
        raise RuntimeError(f"expected one generation per step: {len(gen.calls)} generate, "
                           f"{len(score.calls)} generate-and-score calls for {total} steps")
    w = a.warmup_steps
    gen_s, gen_tok = gen.calls[w:total], gen.results[w:total]
    score_s = [s - g for s, g in zip(score.calls[w:total], gen_s)]
    update_s = [st - s for st, s in zip(steps, score.calls[w:total])]
    upd_tok = [r["prompt"] + r["completion"] for r in score.results[w:total]]
    med = statistics.median
    return dict(steps=a.steps, warmup_steps=w, prompts_per_step=a.prompts_per_step,
                completions_per_prompt=a.completions, completions_per_step=per_step_completions,
                max_new_tokens=a.max_new_tokens, loss_type=args.loss_type, beta=args.beta,
                temperature=args.temperature,
                generation="continuous_batching" if a.continuous_batching else "generate",
                seconds_per_step=med(steps), step_seconds=steps, wall_seconds=wall,
                generation_seconds_per_step=med(gen_s), score_seconds_per_step=med(score_s),
                update_seconds_per_step=med(update_s), generated_tokens=med(gen_tok),
                generated_tokens_per_step=gen_tok,
                update_tokens=med(upd_tok),
                generation_tokens_per_s=sum(gen_tok) / sum(gen_s),
                update_tokens_per_s=sum(upd_tok) / sum(update_s),
                **describe(args), peak_rss_bytes=rss)


# ------------------------------------------------------------------ main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, choices=RECIPES)
    p.add_argument("--mode", default="packing", choices=SFT_MODES, help="sft / prepare")
    p.add_argument("--model", required=True, help="HF causal-LM checkpoint directory")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory (chat template)")
    p.add_argument("--data", required=True, help="JSONL (module docstring)")
    p.add_argument("--rows", type=int, default=None, help="read only the first N rows")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8, help="rows (sft) / pairs (dpo) per step")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    p.add_argument("--lr", type=float, default=None,
                   help="default: 1e-3 for sft, TRL's 1e-6 for dpo / grpo")
    p.add_argument("--precompute-ref", action="store_true",
                   help="dpo: precompute_ref_log_probs=True")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--completions", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--continuous-batching", action="store_true",
                   help="grpo: transformers' continuous batching instead of generate")
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup_steps < 0:
        p.error("--steps must be >= 1 and --warmup-steps >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # Only the JSON line goes to the real stdout: point fd 1 (Python's and C's) at stderr
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    import transformers
    import trl

    with tempfile.TemporaryDirectory(prefix="trl_peer_") as out_dir:
        result = {"prepare": recipe_prepare, "sft": recipe_sft, "dpo": recipe_dpo,
                  "grpo": recipe_grpo}[a.recipe](a, out_dir)
    result = {"recipe": a.recipe, **result, "trl_version": trl.__version__,
              "transformers_version": transformers.__version__,
              "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "attn_implementation": a.attn_implementation, "dtype": "float32",
              "seed": a.seed, "data": a.data}
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
