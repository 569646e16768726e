"""steps/train_sft.py end to end on a tiny model (hidden 64, 2 layers, 128-token packs).

What is proved here, against one uninterrupted reference run (a subprocess, 1 inline worker,
a checkpoint after every step):
- 2 Ray workers (FSDP2 over gloo) follow it: per-step losses within 1e-5, weights within 1e-5;
- SIGKILL + restart gives bit-identical exported weights: killed mid-epoch and again at the
  checkpoint where the loader's shard reader crossed into epoch 2; killed inside each of a
  checkpoint save's five parts in turn; killed at 6 seeded points over data loading, forward,
  optimizer step and checkpoint save (the chaos test), restarted after each kill; a 1-worker
  checkpoint resumed on 2 Ray workers trains the same global batches (losses within 1e-5);
- a corrupted newest checkpoint is refused with a warning naming it, and the previous one used;
- a checkpoint save on a full disk fails the run naming the checkpoint and the bytes it needs,
  and the restart resumes from the checkpoint before it, bit-identical;
- the exported HF checkpoint (full, merged LoRA, PEFT adapter) gives the native model's logits;
- the loss falls; a bad config fails with a ConfigError that names the key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.config.recipes import load_recipe
from posttrain.errors import ConfigError
from posttrain.train.sft import SFTConfig
from steps import train_sft

from functools import partial

from .conftest import assert_weights_close as _assert_weights_close
from .conftest import run_and_kill, run_to_end, safetensors as _safetensors, tiny_recipe
from .golden import check_golden

_run_to_end = partial(run_to_end, "steps.train_sft")
_run_and_kill = partial(run_and_kill, "steps.train_sft")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains the reference runs
TRAIN_ROWS, EVAL_ROWS = 160, 24
MAX_STEPS = 24
MID_EPOCH_STEP = 5
LOSS_ATOL = 1e-5          # 1 vs 2 workers: only the gradient's float summation order differs
WEIGHT_ATOL = 1e-5        # after 24 Adam steps (observed max |diff| ~1.3e-6)
LOGIT_ATOL = 1e-4         # HF vs native, fp32

CONFIG = {
    **tiny_recipe("chat", 128),
    "train": {"max_steps": MAX_STEPS, "tokens_per_step": 512,   # 4 micro-batches of 1 x 128
              "loader": {"packing": {"max_tokens_per_pack": 128, "buffer_samples": 16},
                         "rows_per_batch": 1, "shuffle_buffer_samples": 32, "seed": 0,
                         "epochs": 3},
              "optimizer": {"lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95]},
              "scheduler": {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
              "grad_clip_norm": 1.0, "seed": 0,
              "checkpoint_every_steps": 1, "keep_checkpoints": 100},
    "eval": {"max_batches": 2},
}


@dataclass
class Tiny:
    tmp: Path
    config: Path             # the recipe YAML (run.dir is always overridden)
    ref_dir: Path            # the uninterrupted reference run
    ref_metrics: list[dict]
    boundary_step: int       # first checkpoint whose shard reader is in epoch 2 (see _epoch)

    def metrics(self, run_dir: Path) -> dict[int, dict]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}


def _epoch(run_dir: Path, step: int) -> int:
    """The pass (0-based) the loader's shard reader is in at checkpoint `step`; it runs ahead of
    the rows trained by the shuffle and packing buffers, and its position restarts with a pass."""
    meta = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
    return int(meta["extra"]["loader"]["rows"]["upstream"]["upstream"]["epoch"])












def _run_with_fault(tiny: Tiny, run_dir: Path, fault: str, at: str,
                    marker: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI of a run with one fault (tests/steps/fault_at.py: FAULT POINT:N MARKER)."""
    marker = marker or run_dir.with_suffix(".faults")
    return subprocess.run(
        [sys.executable, str(ROOT / "tests/steps/fault_at.py"), fault, at, str(marker),
         "steps.train_sft", "--config", str(tiny.config), "--run-dir", str(run_dir),
         "--launcher", "inline", "--no-progress"], cwd=ROOT, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    tmp = tmp_path_factory.mktemp("sft")
    for split, rows in (("train", TRAIN_ROWS), ("eval", EVAL_ROWS)):
        lines = (ROOT / "assets" / "data" / "chat" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["run"]["dir"] = str(tmp / "unused")
    cfg["data"]["train"] = [{"name": "chat", "path": str(tmp / "train.jsonl")}]
    cfg["data"]["eval"] = [{"name": "chat", "path": str(tmp / "eval.jsonl")}]
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ref_dir = tmp / "reference"
    _run_to_end(config, ref_dir)
    t = Tiny(tmp, config, ref_dir, [], 0)
    t.ref_metrics = [t.metrics(ref_dir)[s] for s in range(1, MAX_STEPS + 1)]
    epochs = [_epoch(ref_dir, s) for s in range(1, MAX_STEPS + 1)]
    assert epochs[0] == 0 and 1 in epochs, f"the run must cross an epoch boundary: {epochs}"
    t.boundary_step = epochs.index(1) + 1
    assert MID_EPOCH_STEP + 2 < t.boundary_step < MAX_STEPS - 2, epochs
    return t


def test_first_losses_match_the_golden_values(tiny):
    check_golden("sft", [m["loss"] for m in tiny.ref_metrics])


# ---------------------------------------------------------------------------- 1. parity
def test_two_ray_workers_match_one_inline_worker(tiny, local_ray):
    result = train_sft.run(tiny.config, overrides={
        "run.dir": str(tiny.tmp / "ray2"), "run.launcher": "ray", "run.num_workers": 2},
        prepared_dir=str(tiny.ref_dir / "prepared"), show_progress=False)
    assert result["model"]["world_size"] == 2
    got = tiny.metrics(Path(result["run_dir"]))
    for ref in tiny.ref_metrics:
        mine = got[ref["step"]]
        assert mine["real_tokens"] == ref["real_tokens"]
        assert mine["loss_tokens"] == ref["loss_tokens"]
        assert abs(mine["loss"] - ref["loss"]) <= LOSS_ATOL, (ref["step"], mine, ref)
    _assert_weights_close(Path(result["hf_dir"]), tiny.ref_dir / "hf", WEIGHT_ATOL)


# ---------------------------------------------------------------------------- 2. resume
SAVE_PARTS = ("dcp", "rank-00000.json", "meta.json", "manifest.json", "commit")


def test_sigkill_inside_each_part_of_a_checkpoint_save_resumes_from_the_previous_one(tiny):
    """SIGKILL inside each part of a checkpoint save in turn (tests/steps/fault_at.py), one
    run restarted after each kill: the i-th kill tears the save of checkpoint
    MID_EPOCH_STEP + 2i. Each torn attempt is left as a `.tmp-` directory and never loaded:
    the checkpoint before it is the newest complete one, and the restart resumes from it (the
    next kill's marker shows the engine at the step that implies). The last restart ends
    bit-identical to the uninterrupted run, with no torn attempt left behind."""
    run_dir, marker = tiny.tmp / "torn", tiny.tmp / "torn.faults"
    start = 0                                # the checkpoint each run resumes from
    for i, part in enumerate(SAVE_PARTS):
        step = MID_EPOCH_STEP + 2 * i
        proc = _run_with_fault(tiny, run_dir, "kill", f"save/{part}:{step - start}", marker)
        assert proc.returncode == -signal.SIGKILL, (part, proc.stderr.decode()[-3000:])
        hit = json.loads(marker.read_text().splitlines()[-1])
        assert (hit["point"], hit["step"]) == (f"save/{part}", step), hit
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        complete = [n for n in names if ".tmp-" not in n]
        assert complete[-1] == f"step-{step - 1:08d}", (part, names)
        assert any(n.startswith(f"step-{step:08d}.tmp-") for n in names), (part, names)
        start = step - 1
    _run_to_end(tiny.config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (start, MAX_STEPS)
    assert _safetensors(run_dir / "hf") == _safetensors(tiny.ref_dir / "hf")
    got = tiny.metrics(run_dir)
    assert [got[s]["loss"] for s in range(1, MAX_STEPS + 1)] == \
        [m["loss"] for m in tiny.ref_metrics]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]


CHAOS_SEED, CHAOS_KILLS = 0, 6


def chaos_plan(seed: int, kills: int, max_steps: int, micro_batches: int
               ) -> list[tuple[str, int, int]]:
    """`kills` (point, step, micro-batch) triples: every kind (load, forward, optimizer,
    save/<part>) at least once, in seeded order; kill i at a seeded step of the i-th of
    `kills` equal slices of the run, so the kills spread over it (and over the epoch
    boundary), and for load and forward at a seeded micro-batch of that step (1-based)."""
    rng = random.Random(seed)
    kinds = ["load", "forward", "optimizer", "save"]
    kinds += [rng.choice(kinds) for _ in range(kills - len(kinds))]
    rng.shuffle(kinds)
    bounds = [round(i * max_steps / kills) for i in range(kills + 1)]
    plan = []
    for i, kind in enumerate(kinds):
        point = f"save/{rng.choice(SAVE_PARTS)}" if kind == "save" else kind
        plan.append((point, rng.randint(bounds[i] + 1, bounds[i + 1]),
                     rng.randint(1, micro_batches)))
    return plan


def test_chaos_sigkill_at_seeded_points_each_restart_resumes_and_ends_byte_identical(tiny):
    """A run SIGKILLed CHAOS_KILLS times, at seeded points in data loading, forward, optimizer
    step and checkpoint save (tests/steps/fault_at.py), rerun after each kill as a user would:
    every kill lands where planned (its marker names the point and the engine's step, which
    also shows the restart before it resumed from the right checkpoint), and the last run ends
    with the reference's losses and byte-identical safetensors. Catches state a checkpoint
    misses or restores wrongly (loader position, optimizer, scheduler, RNG, step), a torn save
    taken for a checkpoint, and what only shows after several resumes in a row (metrics,
    leftovers of dead attempts)."""
    run_dir, marker = tiny.tmp / "chaos", tiny.tmp / "chaos.faults"
    g = 4                                    # micro-batches per step (CONFIG's tokens_per_step)
    plan = chaos_plan(CHAOS_SEED, CHAOS_KILLS, MAX_STEPS, g)
    start = 0                                # the step each run resumes from
    for point, step, micro in plan:
        # the N-th visit of `point` in this process that lands in step `step`
        if point in ("load", "forward"):
            n, engine_step = (step - start - 1) * g + micro, step - 1
        elif point == "optimizer":
            n, engine_step = step - start, step - 1
        else:
            n, engine_step = step - start, step      # the save of checkpoint `step`
        proc = _run_with_fault(tiny, run_dir, "kill", f"{point}:{n}", marker)
        assert proc.returncode == -signal.SIGKILL, (point, n, proc.stderr.decode()[-3000:])
        hit = json.loads(marker.read_text().splitlines()[-1])
        assert (hit["point"], hit["n"], hit["step"]) == (point, n, engine_step), (plan, hit)
        start = step - 1                     # the checkpoint before `step` (its save was cut)
    assert len(marker.read_text().splitlines()) == CHAOS_KILLS
    _run_to_end(tiny.config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (start, MAX_STEPS)
    assert _safetensors(run_dir / "hf") == _safetensors(tiny.ref_dir / "hf")
    got = tiny.metrics(run_dir)
    assert [got[s]["loss"] for s in range(1, MAX_STEPS + 1)] == \
        [m["loss"] for m in tiny.ref_metrics]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_sigkill_mid_epoch_then_at_the_epoch_boundary_restarts_bit_identical(tiny):
    """Killed right after checkpoint MID_EPOCH_STEP (mid-epoch), restarted, killed again right
    after the checkpoint where the loader's shard reader crossed into epoch 2, restarted to
    the end: each restart resumes where it was killed (the first one crosses the epoch
    boundary itself), and the run ends with the reference's losses and bit-identical weights
    (the chaos test below kills at seeded points all over the run)."""
    run_dir = tiny.tmp / "killed"
    steps = [MID_EPOCH_STEP, tiny.boundary_step]
    for step in steps:
        _run_and_kill(tiny.config, run_dir, step)
        if step == tiny.boundary_step:     # the kill is right after the reader changed epoch
            assert (_epoch(run_dir, step - 1), _epoch(run_dir, step)) == (0, 1)
        else:
            assert _epoch(run_dir, step - 1) == _epoch(run_dir, step) == 0
    _run_to_end(tiny.config, run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (steps[-1], MAX_STEPS)
    assert _safetensors(run_dir / "hf") == _safetensors(tiny.ref_dir / "hf")
    got = tiny.metrics(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert [got[s]["loss"] for s in range(1, MAX_STEPS + 1)] == \
        [m["loss"] for m in tiny.ref_metrics]


@contextlib.contextmanager
def _small_disk(path: Path, size: int):
    """A tmpfs of `size` bytes at `path`, yielding a function that regrows it (keeping its
    files), or None where mounting is not allowed (no root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True)
    if mount.returncode:
        yield None
        return
    try:
        yield lambda new: subprocess.run(
            ["mount", "-o", f"remount,size={new}", str(path)], check=True)
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_checkpoint_save_on_a_full_disk_fails_naming_path_and_bytes_then_resumes(tiny):
    """The checkpoints live on a tmpfs with room for two and a half: the save of checkpoint
    3 hits a real ENOSPC in DCP's shard write (where mounting is not allowed, fault_at.py
    raises it there), the run fails with a message naming the checkpoint and the bytes it
    needs (the previous checkpoint's size, which is the reference's), checkpoint 2 stays the
    newest, and once there is room the restart resumes from it and ends bit-identical.
    Catches a traceback in place of the message, a torn attempt taken for a checkpoint or
    left filling the disk, and a wrong size."""
    run_dir, full_step = tiny.tmp / "full_disk", 3
    files = [p for p in (tiny.ref_dir / "checkpoints" / "step-00000001").rglob("*")
             if p.is_file()]
    pages = sum(-(-p.stat().st_size // 4096) * 4096 for p in files)
    with _small_disk(run_dir / "checkpoints", 2 * pages + pages // 2) as regrow:
        if regrow is None:
            proc = _run_with_fault(tiny, run_dir, "enospc", f"save/dcp:{full_step}")
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "steps.train_sft", "--config", str(tiny.config),
                 "--run-dir", str(run_dir), "--launcher", "inline", "--no-progress"],
                cwd=ROOT, capture_output=True, timeout=300)
        stderr = proc.stderr.decode()
        assert proc.returncode == 2, stderr[-3000:]
        error = stderr[stderr.index("posttrain train-sft: error: "):]
        print(f"{'tmpfs' if regrow else 'injected'}: {error}")
        assert "Traceback" not in stderr
        final = run_dir / "checkpoints" / f"step-{full_step:08d}"
        assert f"checkpoint {final} could not be saved: [Errno 28] No space left on device" \
            in error
        needed = int(re.search(r"needs about ([\d,]+) bytes", error)[1].replace(",", ""))
        previous = run_dir / "checkpoints" / f"step-{full_step - 1:08d}"
        assert needed == sum(p.stat().st_size for p in previous.rglob("*") if p.is_file())
        assert f"resumes from the previous checkpoint, {previous}" in error
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
            [f"step-{s:08d}" for s in range(1, full_step)]
        if regrow is not None:
            regrow(200 << 20)
        _run_to_end(tiny.config, run_dir)
        result = json.loads((run_dir / "result.json").read_text())
        assert (result["started_at_step"], result["steps"]) == (full_step - 1, MAX_STEPS)
        assert _safetensors(run_dir / "hf") == _safetensors(tiny.ref_dir / "hf")


def test_resume_one_worker_checkpoint_on_two_ray_workers(tiny, local_ray):
    step = MID_EPOCH_STEP + 2
    run_dir = tiny.tmp / "resharded"
    (run_dir / "checkpoints").mkdir(parents=True)
    name = f"step-{step:08d}"
    shutil.copytree(tiny.ref_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
    result = train_sft.run(tiny.config, overrides={
        "run.dir": str(run_dir), "run.launcher": "ray", "run.num_workers": 2},
        prepared_dir=str(tiny.ref_dir / "prepared"), show_progress=False)
    assert (result["started_at_step"], result["steps"]) == (step, MAX_STEPS)
    assert result["model"]["world_size"] == 2
    got = tiny.metrics(run_dir)
    assert sorted(got) == list(range(step + 1, MAX_STEPS + 1))
    for ref in tiny.ref_metrics[step:]:
        mine = got[ref["step"]]
        assert (mine["real_tokens"], mine["loss_tokens"], mine["tokens_seen"]) == \
            (ref["real_tokens"], ref["loss_tokens"], ref["tokens_seen"])   # same global batches
        assert abs(mine["loss"] - ref["loss"]) <= LOSS_ATOL, (ref["step"], mine, ref)
    _assert_weights_close(Path(result["hf_dir"]), tiny.ref_dir / "hf", WEIGHT_ATOL)


# ---------------------------------------------------------------------------- 3. corrupt
def test_corrupt_newest_checkpoint_is_refused_and_the_previous_used(tiny, caplog):
    newest, previous = 12, 11
    run_dir = tiny.tmp / "corrupt"
    for step in (previous, newest):
        name = f"step-{step:08d}"
        shutil.copytree(tiny.ref_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
    shard = next((run_dir / "checkpoints" / f"step-{newest:08d}" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # the crashed run's log ran ahead of its checkpoints, its last line cut short
    log = (tiny.ref_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(log + log.splitlines()[5][:40])
    with caplog.at_level(logging.WARNING):
        result = train_sft.run(tiny.config, overrides={"run.dir": str(run_dir)},
                               prepared_dir=str(tiny.ref_dir / "prepared"), show_progress=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"step-{newest:08d}" in m and "damaged" in m and shard.name in m
               for m in warned), warned
    assert (result["started_at_step"], result["steps"]) == (previous, MAX_STEPS)
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in logged if "eval_loss" in r] == [MAX_STEPS]
    got = tiny.metrics(run_dir)
    for ref in tiny.ref_metrics[previous:]:
        assert abs(got[ref["step"]]["loss"] - ref["loss"]) <= LOSS_ATOL


# ---------------------------------------------------------------------------- 4. export
def _native(cfg: SFTConfig, run_dir: Path):
    """The run's last checkpoint, loaded by the engine: a plain native model, its state, args."""
    from posttrain.distributed.env import init_process_group
    from posttrain.train.engine import Engine
    from posttrain.train.export import model_from_state
    init_process_group()
    engine = Engine(cfg.model, cfg.train.engine, str(run_dir / "base_model"), str(run_dir))
    assert engine.load_checkpoint() is not None and engine.step == cfg.train.engine.max_steps
    state = engine.full_state_dict()
    return model_from_state(state, engine.args, cfg.model.lora), state, engine.args


def _native_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model.logits(model(ids))
    return logits[..., :model.args.vocab_size]


TEXT = "What is 12 + 30? 12 + 30 = 42. The answer is 42. Name the capital of Vivenlo."


def _sample_ids() -> torch.Tensor:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tokenizer"))
    return torch.tensor([tok(TEXT)["input_ids"]])


def test_exported_checkpoint_loads_in_transformers_with_the_native_logits(tiny):
    from transformers import AutoModelForCausalLM
    cfg = load_recipe(tiny.config, SFTConfig, {"run.dir": str(tiny.ref_dir)})
    ids = _sample_ids()
    native = _native_logits(_native(cfg, tiny.ref_dir)[0], ids)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny.ref_dir / "hf"), dtype=torch.float32)
    with torch.no_grad():
        got = hf(ids).logits
    assert got.shape == native.shape
    assert (got - native).abs().max().item() <= LOGIT_ATOL      # observed: 0.0
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny.ref_dir / "hf"))
    assert tok(TEXT)["input_ids"] == ids[0].tolist()


def test_lora_run_exports_merged_and_peft(tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.train.export import export_hf
    run_dir = tiny.tmp / "lora"
    overrides = {"run.dir": str(run_dir), "train.max_steps": 6,
                 "train.checkpoint_every_steps": 6, "train.optimizer.lr": 0.01,
                 "model.lora": {"rank": 4, "alpha": 8.0}, "export.format": "merged"}
    result = train_sft.run(tiny.config, overrides=overrides,
                           prepared_dir=str(tiny.ref_dir / "prepared"), show_progress=False)
    assert result["model"]["trainable_params"] < result["model"]["params"] / 5
    cfg = load_recipe(tiny.config, SFTConfig, overrides)
    ids = _sample_ids()
    model, state, args = _native(cfg, run_dir)
    native = _native_logits(model, ids)
    base = AutoModelForCausalLM.from_pretrained(str(run_dir / "base_model"), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(result["hf_dir"], dtype=torch.float32)
    with torch.no_grad():
        base_logits, merged_logits = base(ids).logits, merged(ids).logits
    assert (base_logits - native).abs().max().item() > 100 * LOGIT_ATOL   # LoRA did train
    assert (merged_logits - native).abs().max().item() <= LOGIT_ATOL   # observed: 2.4e-7

    # the peft format from the same trained state, through the function the worker calls
    peft_dir = export_hf(state, args, str(run_dir / "peft"),
                         fmt="peft", lora=cfg.model.lora, base_dir=str(run_dir / "base_model"))
    adapted = PeftModel.from_pretrained(base, peft_dir)
    with torch.no_grad():
        peft_logits = adapted(ids).logits
    assert (peft_logits - native).abs().max().item() <= LOGIT_ATOL


# ---------------------------------------------------------------------------- 5. learning
def test_training_loss_falls(tiny):
    losses = [m["loss"] for m in tiny.ref_metrics]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    vocab = json.loads((tiny.ref_dir / "hf" / "config.json").read_text())["vocab_size"]
    assert first > math.log(vocab) - 0.5           # a random model starts near ln(vocab) = 8.07
    assert last < first - 1.5, (first, last)       # observed ~7.84 -> ~5.2
    result = json.loads((tiny.ref_dir / "result.json").read_text())
    assert result["eval"]["eval_loss"] < math.log(vocab) - 1.0


# ---------------------------------------------------------------------------- 6. config
@pytest.mark.parametrize("override, names", [
    ({"train.tokenz_per_step": 512}, ["train.tokenz_per_step", "unknown key"]),
    ({"train.loader.packing.max_tokens": 64}, ["train.loader.packing.max_tokens"]),
    ({"train.tokens_per_step": 500}, ["tokens_per_step=500", "multiple of"]),
    ({"model.lora": {"rank": 4}}, ["export.format: full", "merged", "peft"]),
])
def test_bad_config_fails_naming_the_key(tiny, override, names):
    with pytest.raises(ConfigError) as err:
        train_sft.run(tiny.config, overrides={"run.dir": str(tiny.tmp / "bad"), **override})
    for name in names:
        assert name in str(err.value)
    assert not (tiny.tmp / "bad").exists()
