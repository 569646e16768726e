"""What the training drivers share: the command line, launching workers, prepared data.

Each recipe driver (`train_sft`, `train_dpo`, `train_reward`, `train_distill`) is a single
controller over rank workers that train through `posttrain.train.engine.Engine`; these are the
pieces that are the same for all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm.auto import tqdm

from posttrain.config.loader import to_dict
from posttrain.config.recipes import OutputConfig, PrepareConfig
from posttrain.train.engine import write_random_hf_model

log = logging.getLogger("posttrain.driver")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--run-dir", help="override run.dir")
    parser.add_argument("--launcher", choices=["ray", "inline"], help="override run.launcher")
    parser.add_argument("--num-workers", type=int, help="override run.num_workers")
    parser.add_argument("--max-steps", type=int, help="override train.max_steps")
    parser.add_argument("--no-progress", action="store_true")


def overrides_from(args: argparse.Namespace) -> dict:
    """The dotted config overrides given on the command line."""
    return {k: v for k, v in {"run.dir": args.run_dir, "run.launcher": args.launcher,
                              "run.num_workers": args.num_workers,
                              "train.max_steps": args.max_steps}.items() if v is not None}


def drop_metrics_after(path: Path, step: int) -> None:
    """Forget logged steps after `step`: a killed run logged them, the resumed one redoes them."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:        # a line cut short by the kill
            continue
        if int(record.get("step", 0)) <= step:
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def ensure_prepared(cfg: Any, out_dir: str, show_progress: bool = True) -> str:
    """Run the prepare step into `out_dir` unless a manifest for this config is there."""
    from steps import prepare
    pcfg = PrepareConfig(tokenizer=cfg.tokenizer, data=cfg.data, output=OutputConfig(dir=out_dir))
    manifest = Path(out_dir) / "manifest.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        if old.get("config") == to_dict(pcfg):
            return out_dir
    prepare.run(pcfg, show_progress=show_progress)
    return out_dir


def base_model_dir(cfg: Any, prepared_dir: str, run_dir: Path) -> str:
    """The HF checkpoint to start from: model.hf_dir, or a random one made from model.init."""
    if cfg.model.hf_dir:
        return cfg.model.hf_dir
    manifest = json.loads((Path(prepared_dir) / "manifest.json").read_text())
    vocab = int(manifest["tokenizer"]["vocab_size"])
    return write_random_hf_model(cfg.model.init, vocab, run_dir / "base_model",
                                 tokenizer_dir=f"{prepared_dir}/tokenizer")


class _Inline:
    """The WorkerGroup interface over one worker in this process."""

    def __init__(self, worker: Any):
        self.worker = worker

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]


@contextlib.contextmanager
def launch_workers(run_cfg: Any, worker_cls: type, args: tuple) -> Iterator[Any]:
    """`run_cfg.num_workers` ranks of `worker_cls(*args)`: Ray actors, or one inline worker.

    Shared by the recipes that train through `Engine` (SFT, distillation)."""
    if run_cfg.launcher == "inline":
        worker = worker_cls(*args)
        try:
            yield _Inline(worker)
        finally:
            worker.close()
        return
    import ray
    from posttrain.distributed.worker_group import WorkerGroup
    started_here = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            ray.init(num_cpus=max(run_cfg.num_workers, os.cpu_count() or 1),
                     include_dashboard=False, log_to_driver=True,
                     _temp_dir=os.environ.get("RAY_TMPDIR"))
            started_here = True
    threads = max(1, (os.cpu_count() or 1) // run_cfg.num_workers)
    try:
        with WorkerGroup(worker_cls, run_cfg.num_workers,
                         resources_per_worker=run_cfg.resources_per_worker or None,
                         env={"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"},
                         init_args=args) as group:
            try:
                yield group
            finally:
                with contextlib.suppress(Exception):
                    group.call("close")
    finally:
        if started_here:
            ray.shutdown()


def step_loop(group: Any, *, name: str, start: int, max_steps: int, checkpoint_every: int,
              writer: Any, show_progress: bool,
              postfix: Callable[[dict], dict[str, str]],
              step_fn: Callable[[int], dict | None] | None = None,
              save_fn: Callable[[int], Any] | None = None) -> list[dict]:
    """The driver's loop: one step, log, checkpoint every K steps.

    A step is `step_fn(step)` (the GRPO controller's) or, by default, `train_step` on every
    rank; a checkpoint is `save_fn(step)` or `save_checkpoint` on every rank. Returns the
    metrics of the steps run here. Stops early (with a warning) when a step returns None (the
    data is exhausted). Without a progress bar (a Metaflow task log, CI) a plain line is logged
    every max_steps/20 steps, so a person can follow the run.
    """
    step_fn = step_fn or (lambda step: group.call("train_step")[0])
    save_fn = save_fn or (lambda step: group.call("save_checkpoint"))
    history: list[dict] = []
    log_every = max(1, max_steps // 20)
    bar = tqdm(total=max_steps, initial=start, desc=name, unit="step", disable=not show_progress)
    for step in range(start, max_steps):
        metrics = step_fn(step)
        if metrics is None:
            log.warning("data exhausted after %d steps (train.max_steps=%d)", step, max_steps)
            break
        writer.write(metrics)
        history.append(metrics)
        shown = postfix(metrics)
        bar.update()
        bar.set_postfix(**shown)
        if not show_progress and metrics["step"] % log_every == 0:
            log.info("%s step %d/%d  %s", name, metrics["step"], max_steps,
                     "  ".join(f"{k} {v}" for k, v in shown.items()))
        if metrics["step"] % checkpoint_every == 0:
            save_fn(metrics["step"])
    bar.close()
    return history
