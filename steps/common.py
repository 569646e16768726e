"""The one training driver: a single controller over the rank workers of any recipe.

    prepare (if needed) -> base HF checkpoint (and a recipe's other models, e.g. a teacher) ->
    launch workers (Ray actors, or one inline) -> before training (DPO's reference pass) ->
    resume from the newest valid checkpoint -> after resume (GRPO: first weight sync, baseline
    evaluation) -> step loop: one step on every rank, log, checkpoint every K steps ->
    evaluate -> export a Hugging Face checkpoint -> result.json

`run_recipe(recipe, config, ...)` is that function; `steps/train_<recipe>.py` only names its
recipe (`posttrain.train.<recipe>`) and what it prints. A step is the workers' `train_step`
(`posttrain.train.recipe.RecipeWorker`) or a recipe controller's (`GRPOController`), which plugs
into the same loop through the `Controller` methods. The driver holds no weights, decides when
to checkpoint, logs and shows progress. A killed run continues from its last complete
checkpoint when started again with the same run directory, and ends with the same weights as
a run that never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm.auto import tqdm

from posttrain.config.loader import to_dict
from posttrain.config.recipes import OutputConfig, PrepareConfig, load_recipe
from posttrain.data.prepared import local_view
from posttrain.errors import ConfigError
from posttrain.process import rank_environment
from steps.arguments import overrides_from

log = logging.getLogger("posttrain.driver")


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
    """Run the prepare step into `out_dir` unless a manifest for this config is there.

    What is prepared is the recipe config's tokenizer and data, or what its `prepare_config`
    method says (the sequence recipe: an event vocabulary and the labels of its heads)."""
    from steps import prepare
    output = OutputConfig(dir=out_dir)
    pcfg = (cfg.prepare_config(output) if hasattr(cfg, "prepare_config") else
            PrepareConfig(tokenizer=cfg.tokenizer, data=cfg.data, output=output))
    manifest = Path(out_dir) / "manifest.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        if old.get("config") == to_dict(pcfg):
            return out_dir
    prepare.run(pcfg, show_progress=show_progress)
    return out_dir


def check_base_model(model: Any) -> None:
    """A local `model.hf_dir` that does not exist is reported with what would make it."""
    from posttrain.config.registry import command
    from posttrain.data.prepared import is_remote
    hf_dir = model.hf_dir
    if is_remote(hf_dir) or (Path(hf_dir) / "config.json").is_file():
        return
    how = (f"it is the export of {model.produced_by}: train it first with "
           f"`{command(model.produced_by)}` (a flow run finds the newest run of it, "
           "or trains it)" if model.produced_by else
           "point model.hf_dir at a Hugging Face checkpoint directory")
    raise ConfigError(f"model.hf_dir: {hf_dir}/config.json not found; {how}")


def base_model_dir(cfg: Any, prepared_dir: str, run_dir: Path) -> str:
    """The HF checkpoint to start from: model.hf_dir, or a random one made from model.init."""
    if cfg.model.hf_dir:
        check_base_model(cfg.model)
        return cfg.model.hf_dir
    from posttrain.models.random_init import write_random_hf_model
    from posttrain.train.recipe import tokenizer_vocab
    return write_random_hf_model(cfg.model.init, tokenizer_vocab(prepared_dir),
                                 run_dir / "base_model",
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

    `args` are the worker's constructor arguments."""
    if run_cfg.launcher == "inline":
        worker = worker_cls(*args)
        try:
            yield _Inline(worker)
        finally:
            worker.close()
        return
    import ray
    from posttrain.distributed.worker_group import WorkerGroup
    if _LOCAL_RAY is None and not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            start_local_ray(run_cfg)
    started_here = _LOCAL_RAY is not None
    if started_here:
        _LOCAL_RAY.wait()                   # (started early, or just now)
    # torch threads per rank: the CPUs its bundle asks for, else an equal share of this machine
    threads = int(run_cfg.resources_per_worker.get("CPU", 0)) or max(
        1, (os.cpu_count() or 1) // run_cfg.num_workers)
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if not float(run_cfg.resources_per_worker.get("GPU", 0)):
        env.update(rank_environment())      # a CPU rank's heap on huge pages (module doc)
    try:
        with WorkerGroup(worker_cls, run_cfg.num_workers,
                         resources_per_worker=run_cfg.resources_per_worker or None,
                         env=env, init_args=args) as group:
            try:
                yield group
            finally:
                with contextlib.suppress(Exception):
                    group.call("close")
    finally:
        if started_here:
            stop_local_ray()


# --------------------------------------------------------------------------- this machine's Ray


def lean_ray_options(run_cfg: Any) -> dict[str, Any]:
    """`ray.init` arguments of the Ray a driver starts on its own machine: the CPUs the ranks
    need (at least this machine's), and nothing a run does not use: no dashboard, no idle
    Python workers started ahead (the ranks' processes start with their own environment, so
    they could not use them) and no metrics export."""
    return {"num_cpus": max(run_cfg.num_workers, os.cpu_count() or 1),
            "include_dashboard": False, "log_to_driver": True,
            "_temp_dir": os.environ.get("RAY_TMPDIR"),
            "_system_config": {"enable_worker_prestart": False,
                               "prestart_worker_first_driver": False,
                               "enable_metrics_collection": False}}


class _LocalRay:
    """This machine's Ray, started by `ray.init` in a background thread (`start_local_ray`).

    The thread lives until `stop`, and stops Ray itself: Ray ties its daemons' lives to the
    thread that started them (the parent-death signal follows the creating thread), so they
    would die with a thread that only ran `ray.init`."""

    def __init__(self, options: dict[str, Any]):
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.ready, self.done = threading.Event(), threading.Event()
        # what ray.init does when called in the main thread: SIGTERM exits through
        # SystemExit, so `finally` blocks and atexit (Ray's own shutdown) run
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        self.thread = threading.Thread(target=self._run, args=(options,), name="local-ray",
                                       daemon=True)
        self.thread.start()

    def _run(self, options: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        ray_log = logging.getLogger("ray._private.worker")
        sigterm_note = _DropMessage("SIGTERM handler is not set")      # set above instead
        ray_log.addFilter(sigterm_note)
        try:
            import ray
            ray.init(**options)
        except BaseException as e:          # raised in the driver by wait()
            self.error = e
            return
        finally:
            ray_log.removeFilter(sigterm_note)
            self.seconds = round(time.perf_counter() - t0, 3)
            self.ready.set()
        self.done.wait()
        # The autoscaler's monitor answers SIGTERM by reporting to the GCS, which ray.shutdown
        # has already stopped, and is killed after a second; a one-machine cluster has nothing
        # to autoscale, so it goes first and at once.
        with contextlib.suppress(Exception):
            ray._private.worker._global_node.kill_monitor(check_alive=False)
        ray.shutdown()

    def wait(self) -> None:
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_LOCAL_RAY: _LocalRay | None = None


def start_local_ray(run_cfg: Any) -> None:
    """Start, in the background, the Ray that `launch_workers` would start for `run_cfg`
    (`launcher: ray`, no cluster to join in RAY_ADDRESS, none running here): its few seconds
    then pass while the driver imports, prepares and writes the base model, instead of before
    the workers. `launch_workers` waits for it and stops it when the workers are done;
    `stop_local_ray` stops it on a path that never reaches them."""
    global _LOCAL_RAY
    if run_cfg.launcher != "ray" or os.environ.get("RAY_ADDRESS") or _LOCAL_RAY is not None:
        return
    import ray
    if not ray.is_initialized():
        _LOCAL_RAY = _LocalRay(lean_ray_options(run_cfg))


def stop_local_ray() -> None:
    """Stop the Ray `start_local_ray` started; nothing when there is none."""
    global _LOCAL_RAY
    if _LOCAL_RAY is not None:
        local, _LOCAL_RAY = _LOCAL_RAY, None
        local.stop()


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


# --------------------------------------------------------------------------- the driver


class Controller:
    """The step loop's view of a run: by default every rank's worker does each part; a recipe
    with a controller of its own (GRPO: rollouts, rewards, weight sync) overrides the parts."""

    def __init__(self, cfg: Any, group: Any, context: dict[str, Any]):
        self.cfg, self.group, self.context = cfg, group, context

    def before_training(self) -> dict[str, Any]:
        """With the starting weights, before resume (DPO's reference pass)."""
        return self.group.call("before_training")[0]

    def resume(self) -> int:
        return self.group.call("resume")[0]

    def after_resume(self, start: int) -> dict[str, Any]:
        """Once the weights are the ones to continue from (GRPO: sync, baseline eval)."""
        return {}

    def step(self, step: int) -> dict | None:
        return self.group.call("train_step")[0]

    def save(self, step: int) -> None:
        self.group.call("save_checkpoint")

    def evaluate(self) -> dict[str, Any]:
        return self.group.call("evaluate")[0]

    def result(self) -> dict[str, Any]:
        """What the controller adds to the run's result (GRPO: sample completions)."""
        return {}

    def close(self) -> None:
        pass


def run_recipe(recipe: Any, config: Any, *, overrides: dict | None = None,
               prepared_dir: str | None = None, checkpoint_dir: str | None = None,
               show_progress: bool = True, worker: type | None = None,
               controller: type[Controller] = Controller,
               models: Callable[[Any, str, Path], dict[str, str]] | None = None,
               lineage: dict[str, str] | None = None) -> dict[str, Any]:
    """Train `recipe` (a `posttrain.train.recipe.Recipe` class) with `config` (its config, or a
    YAML path with dotted `overrides`), evaluate and export; returns paths and metrics.

    `prepared_dir` (local or ``s3://``) skips the prepare step; `checkpoint_dir` (local or
    ``s3://``, default `run.dir`) is where `checkpoints/` (and state such as DPO's reference
    log-probs) live, so a retried or resumed orchestrator task that passes the same value
    continues from the last checkpoint. `worker` is the rank worker class (default the kernel's
    `RecipeWorker`), `controller` the step loop's view of the run, `models(cfg, prepared_dir,
    run_dir)` the recipe's other model directories (a teacher), handed to every worker.
    `lineage` is what the caller knows of the run (a flow's ``metaflow.*`` ids), for the
    tags of `run.trackers` (`posttrain.train.trackers`).
    """
    from posttrain.train.recipe import RecipeWorker, tokenizer_vocab
    cfg = (config if isinstance(config, recipe.config_cls)
           else load_recipe(config, recipe.config_cls, overrides))
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.hf_dir:
        check_base_model(cfg.model)         # before any work: a missing base names its maker
    start_local_ray(cfg.run)                # starts while the driver prepares (launch_workers)
    try:
        prepared_dir = prepared_dir or ensure_prepared(cfg, str(run_dir / "prepared"),
                                                       show_progress)
        local = local_view(prepared_dir)
        hf_dir = base_model_dir(cfg, local, run_dir)
        model_dirs = models(cfg, local, run_dir) if models else {}
    except BaseException:
        stop_local_ray()
        raise
    from posttrain.train.metrics import MetricsWriter
    state_dir = checkpoint_dir or str(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    writer = MetricsWriter(metrics_path, tensorboard_dir=cfg.run.tensorboard_dir)
    from posttrain.plan import host_budget
    # what each CPU trainer rank may keep resident: its planned peak (`HostHeap`), planned
    # from what the ranks build: this base checkpoint and the vocabulary prepare recorded
    budget = host_budget(cfg, hf_dir=hf_dir, vocab_size=tokenizer_vocab(prepared_dir))
    args = (to_dict(cfg), hf_dir, prepared_dir, state_dir, model_dirs, budget)
    if worker is None:                  # the kernel's worker runs the recipe it is given
        worker, args = RecipeWorker, (recipe, *args)
    seconds = Seconds()
    seconds.start("workers")                # what is left of Ray's start, actors, model build
    with launch_workers(cfg.run, worker, args) as group:
        info = group.call("describe")[0]
        seconds.stop("workers")
        if _LOCAL_RAY is not None:          # Ray's start, in the background since run_recipe began
            seconds.parts["ray_start"] = _LOCAL_RAY.seconds
        ctl = controller(cfg, group, {"hf_dir": hf_dir, "prepared_dir": prepared_dir,
                                      "writer": writer, "info": info})
        try:
            with seconds("before_training"):    # resume; reference passes, engines
                before = ctl.before_training()
                start = ctl.resume()
                drop_metrics_after(metrics_path, start)
                trackers = open_run_trackers(cfg, recipe.name, start, state_dir=state_dir,
                                             run_dir=run_dir, prepared_dir=local,
                                             hf_dir=hf_dir, context=lineage,
                                             history=metrics_path)
                writer.add_mirror(trackers)
                log.info("%s: %s params (%s trainable) on %d worker(s), from step %d",
                         recipe.name, f"{info['params']:,}", f"{info['trainable_params']:,}",
                         info["world_size"], start)
                before.update(ctl.after_resume(start))
            with seconds("training"):
                history = step_loop(group, name=recipe.name, start=start,
                                    max_steps=cfg.train.engine.max_steps,
                                    checkpoint_every=cfg.train.engine.checkpoint_every_steps,
                                    writer=writer, show_progress=show_progress,
                                    postfix=recipe.postfix, step_fn=ctl.step, save_fn=ctl.save)
            with seconds("in_loop_evaluation"):
                evaluation = ctl.evaluate()
            if evaluation:
                writer.write({"step": start + len(history), **evaluation})
            export_dir = str(run_dir / "hf")
            with seconds("export"):
                group.call("export", export_dir)
        except BaseException:
            writer.close(ok=False)
            raise
        finally:
            ctl.close()
            seconds.start("shutdown")
    seconds.stop("shutdown")
    writer.close()
    result = {"recipe": recipe.name, "run_dir": str(run_dir), "hf_dir": export_dir,
              "prepared_dir": prepared_dir, "base_model_dir": hf_dir,
              **{f"{k}_dir": v for k, v in model_dirs.items()},
              "metrics_path": str(metrics_path),
              "checkpoint_dir": f"{state_dir.rstrip('/')}/checkpoints",
              "started_at_step": start, "steps": start + len(history), "eval": evaluation,
              "model": info, "config": to_dict(cfg), **before, **ctl.result(),
              **({"trackers": trackers.runs} if trackers else {}),
              **recipe.result(history), "seconds": seconds.parts}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def open_run_trackers(cfg: Any, recipe: str, start: int, *, state_dir: str, run_dir: Path,
                      prepared_dir: str, hf_dir: str, context: dict[str, str] | None,
                      history: Path) -> Any:
    """The run's `run.trackers`, started (or resumed past checkpoint `start`, with the metrics
    `history` up to it) and tagged with its lineage; None without trackers."""
    if not cfg.run.trackers:
        return None
    from posttrain.train.metrics import read_metrics
    from posttrain.train.trackers import open_trackers, run_lineage
    config = to_dict(cfg)
    base = hf_dir if cfg.model.hf_dir else f"random init ({cfg.model.init.family})"
    lineage = run_lineage(recipe, config, run_dir=str(run_dir), prepared_dir=prepared_dir,
                          base_model=base, code_root=Path(__file__).resolve().parents[1],
                          context=context)
    return open_trackers(cfg.run.trackers, state_dir=state_dir, run_dir=str(run_dir),
                         start_step=start, config=config, lineage=lineage,
                         history=read_metrics(history) if start and history.is_file() else [])


class Seconds:
    """Wall seconds of a driver's parts, by name (`with seconds("export"): ...`, or
    `start`/`stop` where a part ends inside another's block)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if name in self._started:
            self.parts[name] = round(time.perf_counter() - self._started.pop(name), 3)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)


def summarize(recipe: Any, result: dict, seconds: float) -> str:
    """The console lines after a run: steps and time, the recipe's lines, where things are."""
    resumed = result["started_at_step"]
    lines = [f"{recipe.name}: trained {result['steps']} steps in {seconds:.0f} s"
             + (f" (resumed at step {resumed})" if resumed else "")]
    lines += recipe.summary(result)
    lines += [f"Hugging Face checkpoint: {result['hf_dir']}",
              f"metrics: {result['metrics_path']}"]
    return "\n".join(lines)


def main_for(recipe: Any, run: Callable[..., dict]) -> Callable[[argparse.Namespace], int]:
    """The `posttrain train-<recipe>` entry point of a recipe's `run`."""
    def main(args: argparse.Namespace) -> int:
        t0 = time.time()
        result = run(args.config, overrides=overrides_from(args),
                     show_progress=not args.no_progress)
        print(summarize(recipe, result, time.time() - t0))
        return 0
    return main
