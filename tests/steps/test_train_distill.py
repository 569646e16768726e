"""steps/train_distill.py end to end on tiny models.

The teacher is a tiny Qwen3 (3 layers, hidden 64) SFT-trained here for a few steps, so that its
next-token distributions are peaked like a real teacher's; the student is a random 2-layer one.
Against one uninterrupted reference run per teacher signal (a CLI subprocess, 1 inline worker,
a checkpoint after every step), this shows:
- distillation lowers the held-out KL(teacher || student), online and from stored top-k;
- SIGKILL + restart gives bit-identical exported student weights, online and offline (the top-k
  loader's state included);
- 2 Ray workers (teacher and student both sharded with FSDP2 over gloo) follow 1 inline worker;
- a teacher whose tokenizer or vocabulary differs is refused at launch with a clear message.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from posttrain.errors import ConfigError
from steps import evaluate, train_distill, train_sft

from functools import partial

from .conftest import run_and_kill, run_to_end, safetensors as _safetensors
from .golden import check_golden

_run_to_end = partial(run_to_end, "steps.train_distill")
_run_and_kill = partial(run_and_kill, "steps.train_distill")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a module fixture trains the reference runs
TRAIN_ROWS, EVAL_ROWS = 160, 24
MAX_STEPS = 16
KILL_STEP = 5
LOSS_ATOL = 1e-5

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}
TRAIN = {"tokens_per_step": 512,                             # 4 micro-batches of 1 x 128
         "loader": {"packing": {"max_tokens_per_pack": 128, "buffer_samples": 16},
                    "rows_per_batch": 1, "shuffle_buffer_samples": 32, "seed": 0, "epochs": 3},
         "optimizer": {"lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95]},
         "scheduler": {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
         "grad_clip_norm": 1.0, "seed": 0, "checkpoint_every_steps": 1, "keep_checkpoints": 100}


def _base(tmp: Path, layers: int, seed: int) -> dict:
    return {"run": {"num_workers": 1, "launcher": "inline", "dir": str(tmp / "unused")},
            "tokenizer": {"path": str(ROOT / "assets" / "tokenizer")},
            "data": {"format": "chat", "max_tokens_per_sample": 128, "on_bad_row": "skip",
                     "train": [{"name": "chat", "path": str(tmp / "train.jsonl")}],
                     "eval": [{"name": "chat", "path": str(tmp / "eval.jsonl")}]},
            "model": {"init": {"family": "qwen3", "seed": seed,
                               "overrides": {**TINY, "num_hidden_layers": layers}},
                      "dtype": "float32"},
            "eval": {"max_batches": 2}}


class Tiny:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.teacher = ""
        self.prepared = ""
        self.configs: dict[str, Path] = {}
        self.refs: dict[str, Path] = {}

    def metrics(self, run_dir: Path) -> dict[int, dict]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}










@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    tmp = tmp_path_factory.mktemp("distill")
    for split, rows in (("train", TRAIN_ROWS), ("eval", EVAL_ROWS)):
        lines = (ROOT / "assets" / "data" / "chat" / f"{split}.jsonl").read_text().splitlines()
        (tmp / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")
    t = Tiny(tmp)
    # the teacher: 3 layers, SFT-trained briefly (its distributions are peaked)
    teacher_cfg = {**_base(tmp, layers=3, seed=1),
                   "train": {**TRAIN, "max_steps": 30, "checkpoint_every_steps": 30}}
    teacher_cfg["run"]["dir"] = str(tmp / "teacher")
    (tmp / "teacher.yaml").write_text(yaml.safe_dump(teacher_cfg))
    result = train_sft.run(tmp / "teacher.yaml", show_progress=False)
    t.teacher, t.prepared = result["hf_dir"], result["prepared_dir"]
    for signal_ in ("online", "offline"):
        cfg = {**_base(tmp, layers=2, seed=0), "train": {**TRAIN, "max_steps": MAX_STEPS},
               "teacher": {"hf_dir": t.teacher, "signal": signal_, "topk": 16}}
        t.configs[signal_] = tmp / f"{signal_}.yaml"
        t.configs[signal_].write_text(yaml.safe_dump(cfg))
        t.refs[signal_] = tmp / f"ref_{signal_}"
        _run_to_end(t.configs[signal_], t.refs[signal_])
    return t


# ---------------------------------------------------------------------------- 1. learning
@pytest.mark.parametrize("signal_", ["online", "offline"])
def test_first_losses_match_the_golden_values(tiny, signal_):
    metrics = tiny.metrics(tiny.refs[signal_])
    check_golden(f"distill_{signal_}", [metrics[s]["loss"] for s in sorted(metrics)])


@pytest.mark.parametrize("signal_", ["online", "offline"])
def test_distillation_lowers_heldout_kl(tiny, signal_):
    ref = tiny.refs[signal_]
    result = json.loads((ref / "result.json").read_text())
    suite = evaluate.recipe_suite("distill", tiny.configs[signal_], {"teacher": tiny.teacher},
                                  overrides={"eval.max_samples": 64})
    ev = evaluate.run(suite, result["hf_dir"], result["base_model_dir"]).tasks[0]
    before, after = ev.baseline["kl_teacher_model"], ev.model["kl_teacher_model"]
    print(f"{signal_}: held-out KL(teacher || student) {before:.4f} -> {after:.4f}; student "
          f"loss {ev.baseline['loss']:.4f} -> {ev.model['loss']:.4f}")
    assert after < 0.75 * before, (before, after)
    assert ev.model["loss"] < ev.baseline["loss"] - 0.5
    losses = [tiny.metrics(ref)[s]["loss"] for s in range(1, MAX_STEPS + 1)]
    assert sum(losses[-3:]) < sum(losses[:3])
    if signal_ == "offline":
        manifest = json.loads((Path(result["prepared_dir"]) / "teacher_topk" /
                               "manifest.json").read_text())
        assert manifest["k"] == 16 and manifest["rows"] > 0
        assert result["model"]["teacher_signal"] == "offline"
        assert "teacher_params" not in result["model"]          # no teacher was built
    else:
        assert result["model"]["teacher_params"] > result["model"]["params"]
        assert result["eval"]["eval_loss"] > 0


# ---------------------------------------------------------------------------- 2. resume
@pytest.mark.parametrize("signal_", ["online", "offline"])
def test_sigkill_and_restart_gives_bit_identical_student(tiny, signal_):
    run_dir = tiny.tmp / f"killed_{signal_}"
    _run_and_kill(tiny.configs[signal_], run_dir, KILL_STEP)
    if signal_ == "online":  # the frozen teacher is rebuilt on restart, not checkpointed
        from torch.distributed.checkpoint import FileSystemReader
        ckpt = run_dir / "checkpoints" / f"step-{KILL_STEP:08d}" / "dcp"
        saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        assert any(k.startswith("model.model.") for k in saved)
        assert not any(k.startswith("model.teacher.") for k in saved)
    _run_to_end(tiny.configs[signal_], run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["started_at_step"], result["steps"]) == (KILL_STEP, MAX_STEPS)
    assert _safetensors(run_dir / "hf") == _safetensors(tiny.refs[signal_] / "hf")
    got, ref = tiny.metrics(run_dir), tiny.metrics(tiny.refs[signal_])
    assert [got[s]["loss"] for s in range(1, MAX_STEPS + 1)] == \
        [ref[s]["loss"] for s in range(1, MAX_STEPS + 1)]


# ---------------------------------------------------------------------------- 3. parallel
def test_two_ray_workers_follow_one_inline_worker(tiny):
    import ray
    ray_tmp = tempfile.mkdtemp(prefix="ptd", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_tmp, log_to_driver=False,
             configure_logging=False)
    try:
        steps = 4
        result = train_distill.run(tiny.configs["online"], overrides={
            "run.dir": str(tiny.tmp / "ray2"), "run.launcher": "ray", "run.num_workers": 2,
            "train.max_steps": steps, "train.checkpoint_every_steps": steps},
            prepared_dir=tiny.prepared, show_progress=False)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result["model"]["world_size"] == 2
    got, ref = tiny.metrics(Path(result["run_dir"])), tiny.metrics(tiny.refs["online"])
    for s in range(1, steps + 1):
        assert got[s]["loss_tokens"] == ref[s]["loss_tokens"]
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= LOSS_ATOL, (s, got[s], ref[s])


# ---------------------------------------------------------------------------- 4. teacher check
def _teacher_copy(tiny, name: str) -> Path:
    out = tiny.tmp / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(tiny.teacher, out)
    return out


def _refused(tiny, teacher: Path, name: str) -> str:
    run_dir = tiny.tmp / name
    with pytest.raises(ConfigError) as err:
        train_distill.run(tiny.configs["online"], overrides={
            "run.dir": str(run_dir), "teacher.hf_dir": str(teacher)},
            prepared_dir=tiny.prepared, show_progress=False)
    assert not (run_dir / "checkpoints").exists()          # refused before any worker started
    return str(err.value)


def test_teacher_with_another_tokenizer_is_refused_at_launch(tiny):
    teacher = _teacher_copy(tiny, "teacher_other_tokenizer")
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]           # two tokens swap their ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    message = _refused(tiny, teacher, "refused_tokenizer")
    assert str(teacher) in message and "tokenizer differs" in message and repr(a) in message


def test_teacher_with_another_vocab_size_is_refused_at_launch(tiny):
    teacher = _teacher_copy(tiny, "teacher_other_vocab")
    config = json.loads((teacher / "config.json").read_text())
    config["vocab_size"] += 64
    (teacher / "config.json").write_text(json.dumps(config))
    message = _refused(tiny, teacher, "refused_vocab")
    assert f"vocab_size {config['vocab_size']}" in message and "student's" in message


def test_teacher_without_tokenizer_files_is_refused_at_launch(tiny):
    teacher = _teacher_copy(tiny, "teacher_no_tokenizer")
    for f in teacher.glob("tokenizer*"):
        f.unlink()
    assert "no tokenizer files" in _refused(tiny, teacher, "refused_no_tokenizer")
