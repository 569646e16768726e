"""What each flow deploys to Argo Workflows, read offline from `argo-workflows create --only-json`.

For every flow in flows/*_flow.py and every config of its recipe (the directory of the flow's
`Config` default), `python flows/<x>.py --datastore=s3 --config config <yaml> argo-workflows
create --only-json` runs with the profile infra/metaflow/config_kubernetes.json. Metaflow
uploads the code package while compiling, so a moto S3 server stands in for the bucket that
the profile names; nothing else is reached (no cluster, no metadata service).

The WorkflowTemplate must: use the profile's image, namespace, ServiceAccount and secrets; give
every step's container cpu and memory requests; carry the retries the flow's @retry
decorators declare; make the @parallel training step a JobSet (1 control + num-parallel - 1
workers, num-parallel coming from the step before it at run time) whose every node asks for
the GPUs the config's workers need on that node; and carry the cron of a @schedule.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from .conftest import PROFILES, REPO, check_as, check_k8s_object, read_profile

FLOWS = sorted(p for p in (REPO / "flows").glob("*_flow.py") if not p.name.startswith("_"))
CREATE_TIMEOUT_S = 120


# --------------------------------------------------------------------------- the flows' source
@dataclass(frozen=True)
class FlowSource:
    """What a flow file declares, read from its syntax tree (the flow is not imported)."""

    path: Path
    config_default: str | None                                  # Config(name, default=...)
    retries: dict[str, int] = field(default_factory=dict)       # step -> @retry(times=)
    steps: tuple[str, ...] = ()
    ray_steps: tuple[str, ...] = ()                             # steps under @ray_nodes
    scheduled: bool = False
    config_name: str = "config"                                 # the Config's name


def _name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


# base flows whose steps a flow inherits (flows/_recipe_flow.py: start, prepare, join)
BASE_FLOWS = {c.name: c for c in ast.parse((REPO / "flows" / "_recipe_flow.py").read_text()).body
              if isinstance(c, ast.ClassDef)}


def read_flow(path: Path) -> FlowSource:
    tree = ast.parse(path.read_text())
    constants = {t.id: stmt.value.value for stmt in tree.body if isinstance(stmt, ast.Assign)
                 and isinstance(stmt.value, ast.Constant) for t in stmt.targets
                 if isinstance(t, ast.Name)}
    flows = [c for c in tree.body if isinstance(c, ast.ClassDef)
             and any(_name(b) == "FlowSpec" or _name(b) in BASE_FLOWS for b in c.bases)]
    assert len(flows) == 1, f"{path.name}: expected one FlowSpec class, found {len(flows)}"
    cls = flows[0]
    own = {fn.name for fn in cls.body if isinstance(fn, ast.FunctionDef)}
    inherited = [fn for b in cls.bases if _name(b) in BASE_FLOWS
                 for fn in BASE_FLOWS[_name(b)].body
                 if isinstance(fn, ast.FunctionDef) and fn.name not in own]
    configs: list[tuple[str, str | None]] = []              # (name, default) of each Config
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and _name(stmt.value) == "Config":
            kw = {k.arg: k.value for k in stmt.value.keywords}
            value = kw.get("default")
            configs.append((ast.literal_eval(stmt.value.args[0]), None if value is None else
                            constants.get(value.id) if isinstance(value, ast.Name)
                            else ast.literal_eval(value)))
    # one Config: compiled with every config of its recipe; several (a pipeline of recipes):
    # compiled with their defaults
    name, default = configs[0] if len(configs) == 1 else ("config", None)
    steps, ray_steps, retries = [], [], {}
    for fn in inherited + cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = {_name(d): d for d in fn.decorator_list}
        if "step" not in names:
            continue
        steps.append(fn.name)
        if "ray_nodes" in names:
            ray_steps.append(fn.name)
        if "retry" in names:
            deco = names["retry"]
            kw = {k.arg: ast.literal_eval(k.value) for k in getattr(deco, "keywords", [])}
            retries[fn.name] = int(kw.get("times", 3))       # Metaflow's default
    scheduled = any(_name(d) == "schedule" for d in cls.decorator_list)
    return FlowSource(path, default, retries, tuple(steps), tuple(ray_steps), scheduled, name)


def gpus_per_node(config_path: Path | None) -> tuple[int, int]:
    """(GPUs each node of the training step needs, num_nodes) from the config: the trainer
    workers' GPUs (`run`), plus those of separately placed GRPO rollout engines (`rollout`).

    Defaults are RunConfig's: one node, one worker, no resources per worker."""
    if config_path is None:
        return 0, 1
    data = yaml.safe_load(config_path.read_text()) or {}
    run = data.get("run") or {}
    nodes, workers = int(run.get("num_nodes", 1)), int(run.get("num_workers", 1))
    total = workers * float((run.get("resources_per_worker") or {}).get("GPU", 0))
    rollout = data.get("rollout") or {}
    if rollout.get("placement") == "separate":
        total += int(rollout.get("num_engines", 1)) * float(
            (rollout.get("resources_per_engine") or {}).get("num_gpus", 0))
    return math.ceil(total / nodes), nodes


def _cases() -> list[tuple[Path, Path | None]]:
    """Every flow with every config of its recipe (the directory of its Config default); a
    flow without a Config default, or with several Configs, is compiled as it is."""
    cases: list[tuple[Path, Path | None]] = []
    for flow in FLOWS:
        default = read_flow(flow).config_default
        if default is None:
            cases.append((flow, None))
            continue
        cases += [(flow, c) for c in sorted((REPO / default).parent.glob("*.yaml"))]
    return cases


CASES = _cases()
IDS = [f"{f.stem}-{c.stem if c else 'default'}" for f, c in CASES]


# --------------------------------------------------------------------------- compiling
@pytest.fixture(scope="session")
def compile_spec(s3, tmp_path_factory, request):
    """flow, config -> the WorkflowTemplate (dict). The first call compiles every (flow, config)
    that the selected tests use, a few at a time (each compile is a Python process of ~4 s)."""
    profile = read_profile("kubernetes")
    bucket = urlparse(profile["METAFLOW_DATASTORE_SYSROOT_S3"]).netloc
    if bucket != s3.bucket:
        s3.client.create_bucket(Bucket=bucket)
    tempdir = tmp_path_factory.mktemp("mftemp")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("METAFLOW_", "AWS_", "ARGO_"))}
    env.update({
        "METAFLOW_HOME": str(PROFILES), "METAFLOW_PROFILE": "kubernetes",
        # the only setting the test adds to the profile: where "S3" is
        "METAFLOW_S3_ENDPOINT_URL": s3.endpoint, "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "METAFLOW_USER": "posttrain-test", "USER": os.environ.get("USER") or "posttrain-test",
        "METAFLOW_TEMPDIR": str(tempdir),      # not metaflow.s3.* dirs in the repository
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    })
    cache: dict[Any, dict] = {}

    def run(case: tuple[Path, Path | None]) -> tuple[Any, subprocess.CompletedProcess, float]:
        flow, config = case
        started = time.monotonic()
        name = read_flow(flow).config_name
        with_config = ["--config", name, str(config.relative_to(REPO))] if config else []
        out = subprocess.run(
            [sys.executable, str(flow.relative_to(REPO)), "--datastore=s3", *with_config,
             "argo-workflows", "create", "--only-json"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S)
        return case, out, time.monotonic() - started

    def store(case, out: subprocess.CompletedProcess, seconds: float) -> None:
        flow, config = case
        label = f"{flow.name} {config.name if config else '(default config)'}"
        assert out.returncode == 0, f"{label}:\n{out.stderr[-4000:]}"
        cache[case] = json.loads(out.stdout[out.stdout.index("{"):])
        print(f"{label}: compiled in {seconds:.1f} s")

    selected = {(item.callspec.params["flow"], item.callspec.params["config"])
                for item in request.session.items
                if hasattr(item, "callspec") and {"flow", "config"} <= item.callspec.params.keys()}

    failed: dict[Any, tuple] = {}          # reported by the tests that ask for them

    def compile_(flow: Path, config: Path | None) -> dict:
        case = (flow, config)
        if case not in cache and case not in failed:
            todo = sorted(selected - cache.keys() - failed.keys() | {case}, key=str)
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                for done, out, seconds in pool.map(run, todo):
                    if out.returncode == 0:
                        store(done, out, seconds)
                    else:
                        failed[done] = (done, out, seconds)
        if case in failed:
            store(*failed[case])
        return cache[case]

    return compile_


# --------------------------------------------------------------------------- reading the spec
def jobset_of(template: dict) -> dict | None:
    """The JobSet a `resource` template creates, parsed (Argo `{{=...}}` values as strings)."""
    resource = template.get("resource")
    if not resource:
        return None
    manifest = re.sub(r"(:\s+)(\{\{=.*\}\})\s*$", lambda m: m.group(1) + json.dumps(m.group(2)),
                      resource["manifest"], flags=re.M)
    return yaml.safe_load(manifest)


def pod_specs(spec: dict) -> list[tuple[str, dict]]:
    """(where, pod-like dict with `containers`) for every pod the spec can start."""
    found = []
    for t in spec["spec"]["templates"]:
        if "container" in t:
            found.append((t["name"], {"containers": [t["container"]],
                                      "serviceAccountName": t.get("serviceAccountName")}))
        jobset = jobset_of(t)
        if jobset:
            for rj in jobset["spec"]["replicatedJobs"]:
                found.append((f"{t['name']}/{rj['name']}", rj["template"]["spec"]["template"]["spec"]))
    return found


def templates(spec: dict) -> dict[str, dict]:
    return {t["name"]: t for t in spec["spec"]["templates"]}


def step_template(spec: dict, step: str) -> dict:
    by_name = templates(spec)
    name = step.replace("_", "-")          # Metaflow's Argo names swap _ for -
    assert name in by_name, f"no template for step {step}: {sorted(by_name)}"
    return by_name[name]


def step_pods(spec: dict, step: str) -> list[dict]:
    """The pod specs of one step: its container, or every replicated job of its JobSet."""
    t = step_template(spec, step)
    if "container" in t:
        return [{"containers": [t["container"]], "serviceAccountName": t.get("serviceAccountName")}]
    jobset = jobset_of(t)
    assert jobset, f"step {step}: neither a container nor a JobSet template"
    return [rj["template"]["spec"]["template"]["spec"] for rj in jobset["spec"]["replicatedJobs"]]


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


# --------------------------------------------------------------------------- tests
def test_every_flow_is_covered():
    names = {f.stem for f in FLOWS}
    assert {"sft_flow", "dpo_flow", "reward_flow", "distill_flow"} <= names
    assert {f.stem for f, _ in CASES} == names


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_spec_is_a_valid_workflow_template(compile_spec, flow: Path, config: Path):
    spec = compile_spec(flow, config)
    assert spec["apiVersion"] == "argoproj.io/v1alpha1" and spec["kind"] == "WorkflowTemplate"
    assert check_k8s_object(spec) == []
    errors = []
    for t in spec["spec"]["templates"]:
        if "container" in t:
            errors += check_as(t["container"], "V1Container", f"{t['name']}.container")
            errors += check_as(t.get("volumes") or [], "list[V1Volume]", f"{t['name']}.volumes")
        jobset = jobset_of(t)
        if jobset:
            errors += check_k8s_object(jobset)
            for rj in jobset["spec"]["replicatedJobs"]:
                errors += check_as(rj["template"], "V1JobTemplateSpec", f"{t['name']}/{rj['name']}")
    assert errors == []


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_spec_uses_the_profile(compile_spec, flow: Path, config: Path):
    profile = read_profile("kubernetes")
    spec = compile_spec(flow, config)
    assert spec["metadata"]["namespace"] == profile["METAFLOW_KUBERNETES_NAMESPACE"]
    secrets = set(filter(None, profile.get("METAFLOW_KUBERNETES_SECRETS", "").split(",")))
    for where, pod in pod_specs(spec):
        assert pod["serviceAccountName"] == profile["METAFLOW_KUBERNETES_SERVICE_ACCOUNT"], where
        for c in pod["containers"]:
            assert c["image"] == profile["METAFLOW_KUBERNETES_CONTAINER_IMAGE"], where
            refs = {(e.get("secretRef") or {}).get("name") for e in c.get("envFrom") or []}
            assert secrets <= refs, f"{where}: envFrom {refs}"
            env = env_of(c)
            if "METAFLOW_STEP_NAME" in env:        # the step containers (not Argo's hooks)
                assert env["METAFLOW_SERVICE_URL"] == profile["METAFLOW_SERVICE_INTERNAL_URL"], where
                assert env["METAFLOW_DATASTORE_SYSROOT_S3"] == profile["METAFLOW_DATASTORE_SYSROOT_S3"]


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_every_step_requests_cpu_and_memory(compile_spec, flow: Path, config: Path):
    spec = compile_spec(flow, config)
    for step in read_flow(flow).steps:
        for pod in step_pods(spec, step):
            for c in pod["containers"]:
                requests = (c.get("resources") or {}).get("requests") or {}
                assert float(requests.get("cpu", 0)) > 0, f"{step}: {c.get('resources')}"
                assert requests.get("memory"), f"{step}: {c.get('resources')}"


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_retries_are_the_flows_retry_decorators(compile_spec, flow: Path, config: Path):
    source = read_flow(flow)
    spec = compile_spec(flow, config)
    for step in source.steps:
        strategy = step_template(spec, step).get("retryStrategy")
        if step in source.retries:
            assert strategy, f"{step} has @retry but its template no retryStrategy"
            assert int(strategy["limit"]) == source.retries[step], (step, strategy)
            assert strategy.get("backoff", {}).get("duration"), (step, strategy)
        else:
            assert not strategy or int(strategy.get("limit", 0)) == 0, (step, strategy)


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_training_step_asks_each_node_for_the_configs_gpus(compile_spec, flow: Path, config: Path):
    """GPUs per node = ceil((num_workers x resources_per_worker.GPU + separate rollout engines'
    GPUs) / num_nodes), on the control and the worker pods of the JobSet alike; a config
    without GPUs asks for none anywhere."""
    source = read_flow(flow)
    spec = compile_spec(flow, config)
    expected, _ = gpus_per_node(config)

    def gpus(c: dict) -> int:
        return int(float(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)))

    for step in source.ray_steps:
        for pod in step_pods(spec, step):
            for c in pod["containers"]:
                assert gpus(c) == expected, (
                    f"{flow.name} with {config.name if config else 'its default config'}: step "
                    f"{step} asks for {gpus(c)} GPUs per node, the config needs {expected}")
    everywhere = [gpus(c) for _, pod in pod_specs(spec) for c in pod["containers"]]
    if expected:
        assert max(everywhere) >= 1, f"{flow.name}: the config needs GPUs, no step asks for any"
    elif config is not None:
        assert max(everywhere) == 0, f"{flow.name} with {config.name}: GPUs for a CPU config"


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_training_step_is_a_jobset_over_the_configured_nodes(compile_spec, flow: Path, config: Path):
    """The JobSet has 1 control + (num-parallel - 1) worker replicas, each one pod (a node);
    num-parallel is the value the step before passes to `self.next(..., num_parallel=)` at run
    time (Metaflow's Argo compiler never makes it a constant), so this checks the wiring, and
    that @metaflow_ray is on exactly when the config asks for several nodes."""
    source = read_flow(flow)
    spec = compile_spec(flow, config)
    _, nodes = gpus_per_node(config)
    for step in source.ray_steps:
        template = step_template(spec, step)
        jobset = jobset_of(template)
        assert jobset and jobset["kind"] == "JobSet", f"{step} is not a JobSet"
        jobs = {rj["name"]: rj for rj in jobset["spec"]["replicatedJobs"]}
        assert set(jobs) == {"control", "worker"}
        assert jobs["control"]["replicas"] == 1
        assert jobs["worker"]["replicas"] == "{{=asInt(inputs.parameters.workerCount)}}"
        for rj in jobs.values():
            assert rj["template"]["spec"]["parallelism"] == rj["template"]["spec"]["completions"] == 1

        # the DAG task that starts the JobSet: workerCount = num-parallel - 1
        callers = [task for t in spec["spec"]["templates"] for task in (t.get("dag") or {}).get("tasks", [])
                   if task["template"] == template["name"]]
        assert len(callers) == 1, callers
        args = {p["name"]: p.get("value") for p in callers[0]["arguments"]["parameters"]}
        assert args["workerCount"] == \
            "{{=sprig.int(sprig.sub(sprig.int(inputs.parameters['num-parallel']),1))}}"
        assert args["num-parallel"] == "{{inputs.parameters.num-parallel}}"
        # ... and num-parallel is an output of the step that calls self.next(..., num_parallel=)
        producers = [t["name"] for t in spec["spec"]["templates"]
                     if any(p["name"] == "num-parallel" and (p.get("valueFrom") or {}).get("path")
                            for p in (t.get("outputs") or {}).get("parameters", []))]
        assert producers, "no step exports num-parallel"

        env = env_of(jobs["control"]["template"]["spec"]["template"]["spec"]["containers"][0])
        assert env["MF_WORLD_SIZE"] == "{{inputs.parameters.num-parallel}}"
        # @ray_nodes adds @metaflow_ray, and with it RAY_AUTH_MODE, only for num_nodes > 1
        assert ("RAY_AUTH_MODE" in env) == (nodes > 1), (nodes, sorted(env))


@pytest.mark.parametrize(("flow", "config"), CASES, ids=IDS)
def test_a_scheduled_flow_carries_its_cron(compile_spec, flow: Path, config: Path):
    spec = compile_spec(flow, config)
    annotations = spec["metadata"].get("annotations") or {}
    if read_flow(flow).scheduled:
        cron = json.loads(annotations["metaflow/cron"])
        assert cron["schedule"], cron
    else:
        assert "metaflow/cron" not in annotations
