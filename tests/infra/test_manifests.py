"""infra/ offline: YAML and JSON parse, Kubernetes objects validate against the API models,
kustomizations are complete, pinned versions agree with infra/versions.yaml, and the names the
Metaflow profile uses exist in the manifests."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from .conftest import (INFRA, K8S, PROFILES, REPO, check_k8s_object, k8s_manifest_files,
                            k8s_objects, load_yaml_docs, read_profile)

OBJECTS = k8s_objects()


def _ids(items):
    return [f"{p.relative_to(K8S)}:{o.get('kind')}/{o.get('metadata', {}).get('name')}"
            for p, o in items]


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_file_parses(path: Path):
    assert load_yaml_docs(path), f"{path} holds no YAML document"


def _metaflow_setting_names() -> set[str]:
    """Names Metaflow reads with from_conf(...), without importing metaflow here (its vendored
    typing_extensions would re-patch `typing` for the torch tests of the same session)."""
    source = Path(importlib.util.find_spec("metaflow").origin).parent / "metaflow_config.py"
    return {f"METAFLOW_{n}" for n in re.findall(r'from_conf\(\s*"([A-Z0-9_]+)"', source.read_text())}


@pytest.mark.parametrize("path", sorted(PROFILES.glob("config_*.json")), ids=lambda p: p.name)
def test_metaflow_profiles_hold_only_known_settings(path: Path):
    profile = json.loads(path.read_text())
    unknown = sorted(set(profile) - _metaflow_setting_names())
    assert not unknown, f"{path.name}: Metaflow reads no setting named {unknown}"
    assert all(isinstance(v, str) for v in profile.values()), "profile values must be strings"


@pytest.mark.parametrize("profile", ["local", "kubernetes"])
def test_metaflow_picks_the_profile_from_metaflow_home(profile: str):
    """METAFLOW_HOME=infra/metaflow METAFLOW_PROFILE=<p> makes Metaflow read config_<p>.json."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFLOW_")}
    env.update(METAFLOW_HOME=str(PROFILES), METAFLOW_PROFILE=profile)
    code = ("import json, metaflow.metaflow_config as c; print(json.dumps({'ds': c.DEFAULT_DATASTORE, "
            "'md': c.DEFAULT_METADATA, 'image': c.KUBERNETES_CONTAINER_IMAGE}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    expected = read_profile(profile)
    assert seen["ds"] == expected["METAFLOW_DEFAULT_DATASTORE"]
    assert seen["md"] == expected["METAFLOW_DEFAULT_METADATA"]
    assert seen["image"] == expected.get("METAFLOW_KUBERNETES_CONTAINER_IMAGE")


# --------------------------------------------------------------------------- API models
@pytest.mark.parametrize(("path", "obj"), OBJECTS, ids=_ids(OBJECTS))
def test_kubernetes_object_validates_against_the_api_model(path: Path, obj: dict):
    assert check_k8s_object(obj) == []


def test_every_object_has_a_namespace_or_is_cluster_scoped():
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    missing = [f"{p.name}:{o['kind']}/{o['metadata']['name']}" for p, o in OBJECTS
               if o["kind"] not in cluster_scoped and not o["metadata"].get("namespace")]
    assert not missing, f"objects without metadata.namespace: {missing}"


_DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x", "namespace": "n"},
    "spec": {"selector": {"matchLabels": {"app": "x"}},
             "template": {"metadata": {"labels": {"app": "x"}},
                          "spec": {"containers": [{"name": "c", "image": "i:1",
                                                   "ports": [{"containerPort": 80}],
                                                   "resources": {"requests": {"cpu": "1"}},
                                                   "env": [{"name": "A", "value": "1"}]}]}}},
}


def _broken(edit) -> dict:
    obj = copy.deepcopy(_DEPLOYMENT)
    edit(obj)
    return obj


def test_the_validator_accepts_a_valid_deployment():
    assert check_k8s_object(_DEPLOYMENT) == []


@pytest.mark.parametrize(("edit", "message"), [
    (lambda o: o["spec"]["template"]["spec"].__setitem__(
        "contaners", o["spec"]["template"]["spec"].pop("containers")), "contaners: unknown field"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolicy", "Sometimes"),
     "not one of"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
     .__setitem__("memory", "4 GB"), "not a quantity"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["env"][0].__setitem__("value", 1),
     "expected str"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"),
     "Invalid value for `name`, must not be `None`"),
    (lambda o: o["spec"].pop("selector"), "Invalid value for `selector`, must not be `None`"),
], ids=["misspelled-field", "bad-enum", "bad-quantity", "number-for-string", "missing-name",
        "missing-selector"])
def test_the_validator_catches(edit, message: str):
    errors = check_k8s_object(_broken(edit))
    assert any(message in e for e in errors), errors


def test_the_validator_checks_custom_resources_structurally():
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": "js"}, "spec": {"replicatedJobs": []}}
    assert check_k8s_object(jobset) == []
    assert check_k8s_object({**jobset, "spec": None}) == ["JobSet/js: spec is missing"]
    assert check_k8s_object({**jobset, "metadata": {}}) == ["JobSet/?: metadata.name is missing"]


# --------------------------------------------------------------------------- kustomize
def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", _kustomizations(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_resources_exist_and_remote_ones_are_pinned(path: Path, versions: dict):
    kust = yaml.safe_load(path.read_text())
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kust["kind"] == "Kustomization"
    for entry in kust["resources"]:
        if urlparse(entry).scheme:
            assert entry in versions["manifests"].values(), \
                f"{path}: remote resource {entry} is not one of infra/versions.yaml's manifests"
            assert re.search(r"/download/v\d+\.\d+\.\d+/", entry), f"{entry} is not a pinned release"
            continue
        target = path.parent / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), \
            f"{path}: resource {entry} does not exist"


def test_every_manifest_is_in_a_kustomization():
    listed = set()
    for kust in _kustomizations():
        for entry in yaml.safe_load(kust.read_text())["resources"]:
            if not urlparse(entry).scheme:
                listed.add((kust.parent / entry).resolve())
    missing = [str(p.relative_to(K8S)) for p in k8s_manifest_files() if p.resolve() not in listed]
    assert not missing, f"not listed in any kustomization.yaml: {missing}"
    top = {e for e in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]}
    assert top == {p.parent.name for p in _kustomizations() if p.parent != K8S}


def test_namespaced_kustomizations_match_their_objects():
    for kust in _kustomizations():
        namespace = yaml.safe_load(kust.read_text()).get("namespace")
        if not namespace:
            continue
        for path, obj in OBJECTS:
            if path.parent == kust.parent and obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == namespace, f"{path}: {obj['kind']}"


# --------------------------------------------------------------------------- versions
def _images(obj: dict) -> list[str]:
    pod = (obj.get("spec", {}).get("template", {}) or {}).get("spec", {})
    return [c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])]


def test_images_are_the_pinned_versions(versions: dict):
    pinned = set(versions["images"].values())
    for path, obj in OBJECTS:
        for image in _images(obj):
            assert image in pinned, f"{path}: image {image} is not pinned in infra/versions.yaml"
            assert ":" in image and not image.endswith(":latest"), image


def test_dockerfile_defaults_are_the_pinned_versions(versions: dict):
    text = (INFRA / "docker" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert args["CUDA_BASE"] == versions["images"]["cuda_base"]
    assert args["UV_IMAGE"] == versions["images"]["uv"]
    assert args["PYTHON_VERSION"] == versions["python"]["python"]
    assert args["TORCH_VERSION"] == versions["python"]["torch"]
    assert args["TORCH_INDEX"] == versions["python"]["torch_index"]
    assert args["PYTHON_VERSION"].startswith("3.11.")
    assert "requirements.txt" in text
    assert "METAFLOW_SKIP_INSTALL_DEPENDENCIES=1" in text


def test_requirements_pin_what_versions_yaml_says(versions: dict):
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)$",
                           (REPO / "requirements.txt").read_text(), flags=re.M))
    assert pins["kubernetes"] == versions["python"]["kubernetes"]
    major, minor, patch = (int(x) for x in pins["kubernetes"].split("."))
    assert (major, minor, patch) < (37, 0, 2), "kubernetes 37.0.2 breaks botocore"
    assert pins["metaflow"] == versions["python"]["metaflow"]


def test_the_kubernetes_client_and_botocore_import_together():
    out = subprocess.run([sys.executable, "-c", "import botocore.session, kubernetes.client; "
                          "botocore.session.get_session().create_client('s3', region_name='us-east-1')"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------------- cross references
def _by_kind(kind: str) -> dict[tuple[str, str], dict]:
    return {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
            for _, o in OBJECTS if o["kind"] == kind}


def _pod_specs():
    for path, obj in OBJECTS:
        template = obj.get("spec", {}).get("template")
        if obj["kind"] in ("Deployment", "StatefulSet") and template:
            yield path, obj, template


def test_services_select_pods_and_name_their_ports():
    workloads = [(o["metadata"]["namespace"], t) for _, o, t in _pod_specs()]
    for (namespace, name), service in _by_kind("Service").items():
        selector = service["spec"]["selector"]
        pods = [t for ns, t in workloads if ns == namespace
                and selector.items() <= t["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {name} selects {len(pods)} pod templates"
        port_names = {p.get("name") for c in pods[0]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: no port {port['targetPort']}"


def test_workloads_select_their_own_pods():
    for path, obj, template in _pod_specs():
        assert obj["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), path


def test_secret_and_configmap_references_resolve():
    secrets, configmaps = _by_kind("Secret"), _by_kind("ConfigMap")
    for path, obj, template in _pod_specs():
        ns = obj["metadata"]["namespace"]
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    assert (ns, src["secretRef"]["name"]) in secrets, f"{path}: {src}"
                if "configMapRef" in src:
                    assert (ns, src["configMapRef"]["name"]) in configmaps, f"{path}: {src}"
            for env in c.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    secret = secrets.get((ns, ref["name"]))
                    assert secret and ref["key"] in secret["stringData"], f"{path}: {env}"


def test_role_bindings_bind_existing_roles_and_service_accounts():
    roles, accounts = _by_kind("Role"), _by_kind("ServiceAccount")
    for (ns, name), binding in _by_kind("RoleBinding").items():
        assert (ns, binding["roleRef"]["name"]) in roles, name
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":
                assert (subject["namespace"], subject["name"]) in accounts, subject


def test_flows_service_account_may_run_jobsets_and_report_to_argo(kubernetes_profile: dict):
    ns = kubernetes_profile["METAFLOW_KUBERNETES_NAMESPACE"]
    account = kubernetes_profile["METAFLOW_KUBERNETES_SERVICE_ACCOUNT"]
    roles = _by_kind("Role")
    granted: set[tuple[str, str, str]] = set()
    for (bns, _), binding in _by_kind("RoleBinding").items():
        if bns == ns and {"kind": "ServiceAccount", "name": account, "namespace": ns} in binding["subjects"]:
            for rule in roles[(ns, binding["roleRef"]["name"])]["rules"]:
                granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                            for v in rule["verbs"]}
    for need in [("jobset.x-k8s.io", "jobsets", "create"), ("jobset.x-k8s.io", "jobsets", "get"),
                 ("argoproj.io", "workflowtaskresults", "create"), ("", "pods", "get")]:
        assert need in granted, f"{account} lacks {need}"


def test_kubernetes_profile_names_what_the_manifests_define(kubernetes_profile: dict):
    p = kubernetes_profile
    ns = p["METAFLOW_KUBERNETES_NAMESPACE"]
    assert ("", ns) in _by_kind("Namespace")
    assert (ns, p["METAFLOW_KUBERNETES_SERVICE_ACCOUNT"]) in _by_kind("ServiceAccount")
    for secret in filter(None, p.get("METAFLOW_KUBERNETES_SECRETS", "").split(",")):
        assert (ns, secret) in _by_kind("Secret"), f"METAFLOW_KUBERNETES_SECRETS: {secret}"
    url = urlparse(p["METAFLOW_SERVICE_INTERNAL_URL"])
    name, svc_ns = url.hostname.split(".")[:2]
    service = _by_kind("Service")[(svc_ns, name)]
    assert url.port in [port["port"] for port in service["spec"]["ports"]]
    datastore = _by_kind("ConfigMap")[("metaflow", "metaflow-datastore")]["data"]
    assert datastore["METAFLOW_DATASTORE_SYSROOT_S3"] == p["METAFLOW_DATASTORE_SYSROOT_S3"]
    assert p["METAFLOW_DEFAULT_DATASTORE"] == "s3" and p["METAFLOW_DEFAULT_METADATA"] == "service"
    assert not p["METAFLOW_KUBERNETES_CONTAINER_IMAGE"].endswith(":latest")
    # @trigger_on_finish: the event bus, the webhook event source and the sensors' account
    assert (ns, p["METAFLOW_ARGO_EVENTS_EVENT_BUS"]) in _by_kind("EventBus")
    source = _by_kind("EventSource")[(ns, p["METAFLOW_ARGO_EVENTS_EVENT_SOURCE"])]
    assert p["METAFLOW_ARGO_EVENTS_EVENT"] in source["spec"]["webhook"]
    assert (ns, p["METAFLOW_ARGO_EVENTS_SERVICE_ACCOUNT"]) in _by_kind("ServiceAccount")
    hook = urlparse(p["METAFLOW_ARGO_EVENTS_WEBHOOK_URL"])
    assert hook.hostname.split(".")[:2] == [f"{source['metadata']['name']}-eventsource-svc", ns]
    assert hook.path == source["spec"]["webhook"][p["METAFLOW_ARGO_EVENTS_EVENT"]]["endpoint"]


def _local_kustomizations() -> list[Path]:
    """Kustomizations whose resources are all in this repository (renderable offline)."""
    return [p for p in _kustomizations() if p.parent != K8S and not any(
        urlparse(e).scheme for e in yaml.safe_load(p.read_text())["resources"])]


@pytest.mark.parametrize("path", _local_kustomizations(), ids=lambda p: p.parent.name)
def test_kustomize_renders_the_same_valid_objects(path: Path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it bundles kustomize)")
    out = subprocess.run([kubectl, "kustomize", str(path.parent)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(o):
        return o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]

    assert sorted(map(key, rendered)) == sorted(key(o) for p, o in OBJECTS if p.parent == path.parent)
    for obj in rendered:
        assert check_k8s_object(obj) == []
