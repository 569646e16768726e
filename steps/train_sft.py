"""Train SFT: Ray trainer actors (FSDP2 over gloo/NCCL) driven step by step from here.

    prepare (if needed) -> base HF checkpoint -> WorkerGroup(SFTWorker) ->
    resume from the newest valid checkpoint -> for each step: train_step on every rank,
    log metrics, checkpoint every K steps -> evaluate -> export a Hugging Face checkpoint

The driver is a single controller: it holds no weights, decides when to checkpoint, logs and
shows progress; each rank runs `posttrain.train.sft.SFTWorker` (see its data rule). A run that
is killed continues from its last complete checkpoint when started again with the same run
directory, and ends with the same weights as a run that never stopped.

Run it without Metaflow:

    posttrain train-sft --config configs/sft/tiny.yaml
    python -m steps.train_sft --config configs/sft/tiny.yaml --launcher inline

`launcher: ray` starts a local Ray cluster when none is running (and stops it at the end), or
joins the one `@metaflow_ray` formed across nodes. `launcher: inline` runs one worker in this
process (no Ray): the quickest path on a laptop and in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from posttrain.config.loader import to_dict
from posttrain.config.recipes import OutputConfig, PrepareConfig, load_recipe
from posttrain.train.engine import write_random_hf_model
from posttrain.train.metrics import MetricsWriter
from posttrain.train.sft import SFTConfig, SFTWorker

log = logging.getLogger("posttrain.train_sft")


def run(config: SFTConfig | str | Path, *, overrides: dict | None = None,
        prepared_dir: str | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Train, evaluate and export; returns paths and the final metrics."""
    cfg = config if isinstance(config, SFTConfig) else load_recipe(config, SFTConfig, overrides)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepared_dir = prepared_dir or ensure_prepared(cfg, str(run_dir / "prepared"), show_progress)
    hf_dir = base_model_dir(cfg, prepared_dir, run_dir)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    history: list[dict] = []
    with _launch(cfg, hf_dir, prepared_dir, str(run_dir)) as group:
        info = group.call("describe")[0]
        start = group.call("resume")[0]
        log.info("training %s params (%s trainable) on %d worker(s), from step %d",
                 f"{info['params']:,}", f"{info['trainable_params']:,}", info["world_size"],
                 start)
        bar = tqdm(total=cfg.train.max_steps, initial=start, desc="sft", unit="step",
                   disable=not show_progress)
        for step in range(start, cfg.train.max_steps):
            metrics = group.call("train_step")[0]
            if metrics is None:
                log.warning("data exhausted after %d steps (train.max_steps=%d)", step,
                            cfg.train.max_steps)
                break
            writer.write(metrics)
            history.append(metrics)
            bar.update()
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['real_tokens_per_s']:.0f}",
                            mfu=f"{metrics['mfu']:.1%}")
            if metrics["step"] % cfg.train.checkpoint_every_steps == 0:
                group.call("save_checkpoint")
        bar.close()
        evaluation = group.call("evaluate")[0]
        writer.write({"step": start + len(history), **evaluation})
        export_dir = str(run_dir / "hf")
        group.call("export", export_dir)
    writer.close()
    result = {"run_dir": str(run_dir), "hf_dir": export_dir, "prepared_dir": prepared_dir,
              "base_model_dir": hf_dir, "metrics_path": str(run_dir / "metrics.jsonl"),
              "started_at_step": start, "steps": start + len(history), "eval": evaluation,
              "model": info, "config": to_dict(cfg)}
    if history:
        result["final_loss"] = history[-1]["loss"]
        result["mean_real_tokens_per_s"] = sum(m["real_tokens_per_s"] for m in history) / len(history)
        result["mean_mfu"] = sum(m["mfu"] for m in history) / len(history)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def ensure_prepared(cfg: SFTConfig, out_dir: str, show_progress: bool = True) -> str:
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


def base_model_dir(cfg: SFTConfig, prepared_dir: str, run_dir: Path) -> str:
    """The HF checkpoint to start from: model.hf_dir, or a random one made from model.init."""
    if cfg.model.hf_dir:
        return cfg.model.hf_dir
    manifest = json.loads((Path(prepared_dir) / "manifest.json").read_text())
    vocab = int(manifest["tokenizer"]["vocab_size"])
    return write_random_hf_model(cfg.model.init, vocab, run_dir / "base_model",
                                 tokenizer_dir=f"{prepared_dir}/tokenizer")


class _Inline:
    """The WorkerGroup interface over one worker in this process."""

    def __init__(self, worker: SFTWorker):
        self.worker = worker

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]


@contextlib.contextmanager
def _launch(cfg: SFTConfig, hf_dir: str, prepared_dir: str, run_dir: str) -> Iterator[Any]:
    args = (to_dict(cfg), hf_dir, prepared_dir, run_dir)
    if cfg.run.launcher == "inline":
        worker = SFTWorker(*args)
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
            ray.init(num_cpus=max(cfg.run.num_workers, os.cpu_count() or 1),
                     include_dashboard=False, log_to_driver=True,
                     _temp_dir=os.environ.get("RAY_TMPDIR"))
            started_here = True
    threads = max(1, (os.cpu_count() or 1) // cfg.run.num_workers)
    try:
        with WorkerGroup(SFTWorker, cfg.run.num_workers,
                         resources_per_worker=cfg.run.resources_per_worker or None,
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="SFT recipe YAML")
    parser.add_argument("--run-dir", help="override run.dir")
    parser.add_argument("--launcher", choices=["ray", "inline"], help="override run.launcher")
    parser.add_argument("--num-workers", type=int, help="override run.num_workers")
    parser.add_argument("--max-steps", type=int, help="override train.max_steps")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in {"run.dir": args.run_dir, "run.launcher": args.launcher,
                                   "run.num_workers": args.num_workers,
                                   "train.max_steps": args.max_steps}.items() if v is not None}
    t0 = time.time()
    result = run(args.config, overrides=overrides, show_progress=not args.no_progress)
    print(summarize(result, time.time() - t0))
    return 0


def summarize(result: dict, seconds: float) -> str:
    ev = result.get("eval", {})
    lines = [f"trained {result['steps']} steps in {seconds:.0f} s "
             f"(resumed at step {result['started_at_step']})" if result["started_at_step"]
             else f"trained {result['steps']} steps in {seconds:.0f} s"]
    if "final_loss" in result:
        lines.append(f"final train loss {result['final_loss']:.4f}; "
                     f"{result['mean_real_tokens_per_s']:.0f} real tokens/s; "
                     f"MFU {result['mean_mfu']:.1%}")
    if ev:
        lines.append(f"held-out loss {ev['eval_loss']:.4f} (perplexity "
                     f"{ev['eval_perplexity']:.2f}) over {ev['eval_tokens']} tokens")
    lines += [f"Hugging Face checkpoint: {result['hf_dir']}",
              f"metrics: {result['metrics_path']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    from steps.cli import main as cli_main
    sys.exit(cli_main(["train-sft", *sys.argv[1:]]))
