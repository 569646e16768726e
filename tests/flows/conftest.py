"""Fixtures for running the flows through Metaflow's Runner API, each run in its own sandbox.

Every run gets its own METAFLOW_HOME, local datastore root, Ray temp dir and run directory
under the test's tmp_path (Ray's under /tmp: its socket paths must stay short), so tests do not
collide with each other or with a developer's own runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml


def _keep_typing_patch_of_the_real_typing_extensions() -> None:
    """Metaflow's vendored `typing_extensions` (older) re-patches `typing._collect_parameters`
    when it is imported after the real one, as happens under pytest; torch.fx and
    torch._dynamo, imported later in this process (the Runner parses the flow's Config here,
    transformers loads models here), then fail with "Type parameter ... without a default
    follows type parameter with a default". Import it now and put the newer patch back."""
    import typing

    import typing_extensions  # noqa: F401
    newer = typing._collect_parameters
    import metaflow._vendor.typing_extensions  # noqa: F401
    typing._collect_parameters = newer


_keep_typing_patch_of_the_real_typing_extensions()

REPO = Path(__file__).resolve().parents[2]
SFT_FLOW = REPO / "flows" / "sft_flow.py"
TINY_SFT = REPO / "configs" / "sft" / "tiny.yaml"
GRPO_FLOW = REPO / "flows" / "grpo_flow.py"
TINY_GRPO = REPO / "configs" / "grpo" / "tiny.yaml"
ARITHMETIC_SFT = REPO / "configs" / "sft" / "arithmetic_tiny.yaml"


@dataclass
class FlowSandbox:
    root: Path
    env: dict[str, str]
    ray_tmpdir: str

    def config(self, base: Path = TINY_SFT, name: str = "config.yaml", *, plan: bool = False,
               **overrides: Any) -> Path:
        """Write `base` with dotted-key overrides as this sandbox's config file `name`.

        The start step's memory plan is off (`run.plan_check: off`) unless `plan`: it is 3 s
        of a task's imports and tracing per run. The SFT flow tests keep it, through the
        `RecipeFlow.start` every recipe flow shares, and tests/lib/plan/test_check.py plans
        each recipe flow's bundled config as its start step would."""
        data = yaml.safe_load(base.read_text())
        data.setdefault("run", {})["dir"] = str(self.root / "runs")
        if not plan:
            data["run"]["plan_check"] = "off"
        for dotted, value in overrides.items():
            node = data
            *parents, last = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        path = self.root / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path


def get_card(sandbox: "FlowSandbox", flow_file: Path, pathspec: str, card_id: str) -> list[dict]:
    """The components of card `card_id` of `pathspec` (<run id>/<step>), read with the flow's
    `card get` command in the sandbox's environment (the in-process client would read the
    card root Metaflow was imported with, not the sandbox's)."""
    import subprocess
    out = sandbox.root / f"{card_id}.html"
    got = subprocess.run([sys.executable, str(flow_file), "card", "get", "--id", card_id,
                          pathspec, str(out)], cwd=REPO, env={**os.environ, **sandbox.env},
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    return card_components(out.read_text())


def card_components(html: str) -> list[dict]:
    """The components (type, and for charts the Vega-Lite spec) inside a Metaflow card's HTML."""
    import base64
    import json
    import re
    found = re.search(r'window.__MF_DATA__\["[^"]+"\] = "([^"]+)"', html)
    assert found, "no card data in the HTML"
    out: list[dict] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") in ("vegaChart", "table", "markdown"):
                out.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(base64.b64decode(found.group(1)))["components"])
    return out


def ray_processes_under(path: str) -> list[str]:
    """Command lines of live Ray daemons (raylet, gcs_server) that belong to `path`."""
    import psutil
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if path in cmd and ("raylet" in cmd or "gcs_server" in cmd):
            found.append(f"{p.info['pid']}: {cmd[:200]}")
    return found


def new_sandbox(root: Path) -> FlowSandbox:
    ray_tmpdir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    env = {
        "USER": os.environ.get("USER") or "posttrain-test",
        "METAFLOW_HOME": str(root / "mfhome"),
        "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(root / "mfroot"),
        "METAFLOW_CARD_LOCALROOT": str(root / "mfroot" / "cards"),
        "METAFLOW_DEFAULT_DATASTORE": "local",
        "METAFLOW_DEFAULT_METADATA": "local",
        "RAY_TMPDIR": ray_tmpdir,
        "TOKENIZERS_PARALLELISM": "false",
        # Metaflow starts the extra local tasks of a parallel step with `python` from PATH.
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    for d in ("mfhome", "mfroot"):
        (root / d).mkdir()
    return FlowSandbox(root=root, env=env, ray_tmpdir=ray_tmpdir)


@pytest.fixture
def sandbox(tmp_path: Path) -> FlowSandbox:
    box = new_sandbox(tmp_path)
    yield box
    shutil.rmtree(box.ray_tmpdir, ignore_errors=True)


@dataclass
class Chain:
    """SFTFlow on the worked arithmetic chats, then GRPOFlow started from its export by
    pathspec (`--sft-run`): real runs in one sandbox, with the configs they ran."""

    sandbox: FlowSandbox
    sft: Any                 # metaflow.Run
    sft_config: Path
    grpo: Any                # metaflow.Run
    grpo_config: Path


@pytest.fixture(scope="session")
def arithmetic_chain(tmp_path_factory) -> Chain:
    """One SFT -> GRPO chain that the GRPO, evaluation and lineage flow tests all inspect:
    the Metaflow runs are what makes a flow test slow, and each of those tests needs a trained
    SFT run (the evaluation test compares it with its starting model) or the chain itself.
    `make test` keeps those files on one worker (tests/conftest.py)."""
    from metaflow import Runner
    box = new_sandbox(tmp_path_factory.mktemp("chain"))
    sft_config = box.config(ARITHMETIC_SFT, name="sft.yaml", **{
        "train.max_steps": 20, "eval.max_batches": 1, "eval.generate.num_samples": 1})
    grpo_config = box.config(TINY_GRPO, name="grpo.yaml", **{
        "train.max_steps": 3, "train.prompts_per_step": 8, "train.checkpoint_every_steps": 2,
        "eval.max_prompts": 16, "eval.num_records": 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("USER", box.env["USER"])
        with Runner(str(SFT_FLOW), cwd=str(REPO), env=box.env, show_output=False,
                    config=[("config", str(sft_config))], pylint=False) as runner:
            sft = runner.run().run
            assert sft.successful, sft
        with Runner(str(GRPO_FLOW), cwd=str(REPO), env=box.env, show_output=False,
                    config=[("config", str(grpo_config))], pylint=False) as runner:
            grpo = runner.run(sft_run=sft.pathspec).run
            assert grpo.successful, grpo
    yield Chain(box, sft, sft_config, grpo, grpo_config)
    shutil.rmtree(box.ray_tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------- kill and resume
def _kill_strays(path: str) -> None:
    """Ray daemons of a killed task (their own session; not in the run's process group)."""
    import psutil
    for line in ray_processes_under(path):
        try:
            psutil.Process(int(line.split(":")[0])).kill()
        except psutil.NoSuchProcess:
            pass


def run_and_kill(sandbox: FlowSandbox, flow_file: Path, configs: dict[str, Path], flow: str,
                 checkpoints: str, step: int, timeout_s: float = 400) -> str:
    """`python <flow_file> run` in its own process group, SIGKILLed (the Metaflow runtime, its
    task and the task's Ray cluster: the machine died) once the train step has committed
    checkpoint `step` under <run's storage root>/`checkpoints`; returns the killed run's id.

    The run's storage root is <run.dir>/<flow>/<run id>, run.dir being the sandbox's `runs`;
    runs of the flow that were there before do not count."""
    import signal
    import subprocess
    import time
    runs = sandbox.root / "runs" / flow
    before = {p.name for p in runs.glob("*")}
    args = [a for name, path in configs.items() for a in ("--config", name, str(path))]
    with open(sandbox.root / "flow.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, str(flow_file), "--no-pylint", *args, "run"],
                                cwd=REPO, env={**os.environ, **sandbox.env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    pattern = f"*/{checkpoints}/checkpoints/step-{step:08d}/manifest.json"
    while not (done := [p for p in runs.glob(pattern)
                        if p.relative_to(runs).parts[0] not in before]):
        assert proc.poll() is None, f"the run ended before checkpoint {step}: see flow.log"
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout_s} s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _kill_strays(sandbox.ray_tmpdir)
    return done[0].relative_to(runs).parts[0]


def resume(sandbox: FlowSandbox, flow_file: Path) -> tuple[Any, str]:
    """`python <flow_file> resume` of the newest run (the killed one): the resumed run (a
    client `Run`) and its output. `resume` takes no config: the origin run's is used."""
    from metaflow import Runner
    with Runner(str(flow_file), cwd=str(REPO), env=sandbox.env, show_output=False,
                pylint=False) as runner:
        executing = runner.resume()
        return executing.run, executing.stdout


def reference_export(sandbox: FlowSandbox, recipe: str, config: Path,
                     sets: dict[str, str] | None = None, timeout_s: float = 400) -> Path:
    """The export of an uninterrupted run of `steps.<recipe>` (the driver a flow's train step
    calls through `train_recipe`) on `config`, run as `python -m steps.<recipe>`: the same
    bytes as the flow's train step (same driver, data and seeds), without a Metaflow run."""
    import subprocess
    run_dir = sandbox.root / f"reference-{recipe}"
    extra = [a for key, value in (sets or {}).items() for a in ("--set", f"{key}={value}")]
    # its own local Ray (with `launcher: ray`), never a cluster this process may have joined
    env = {k: v for k, v in {**os.environ, **sandbox.env}.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", f"steps.{recipe}", "--config", str(config),
                           "--run-dir", str(run_dir), "--no-progress", *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run_dir / "hf"


def safetensors(hf_dir: str | Path) -> dict[str, bytes]:
    """The weight files of an export, by name."""
    files = {p.name: p.read_bytes() for p in sorted(Path(hf_dir).glob("*.safetensors"))}
    assert files, hf_dir
    return files
