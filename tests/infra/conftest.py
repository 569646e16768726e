"""What the infra tests share: loading infra/, and checking Kubernetes objects offline.

`check_k8s_object(obj)` returns the list of problems of one Kubernetes object (empty when it
is valid). For a kind the `kubernetes` client has a model for (V1Deployment, V1Role, ...):

- every key, at every depth, must be a field of the model (`attribute_map`): the client itself
  drops unknown keys without a word, so a misspelled field would otherwise pass;
- scalar types must match (a number where the API wants a string, such as an env var's
  `value: 5432`, is rejected by the API server);
- resource quantities (`cpu`, `memory`, `nvidia.com/gpu`, `storage`) must parse;
- a few enum fields (protocol, imagePullPolicy, restartPolicy, ...) must hold an allowed value
  (the generated client no longer checks enums itself);
- required fields are checked by deserializing into the model with client-side validation
  on (the model's setters raise on a missing required field).

Objects of kinds without a model (CRDs: Argo's WorkflowTemplate, JobSet) get a structural
check: apiVersion, kind, metadata.name and spec.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
K8S = INFRA / "k8s"
PROFILES = INFRA / "metaflow"

# https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")
_ENUMS: dict[tuple[str, str], set[str]] = {
    ("V1ServicePort", "protocol"): {"TCP", "UDP", "SCTP"},
    ("V1ContainerPort", "protocol"): {"TCP", "UDP", "SCTP"},
    ("V1Container", "image_pull_policy"): {"Always", "IfNotPresent", "Never"},
    ("V1PodSpec", "restart_policy"): {"Always", "OnFailure", "Never"},
    ("V1ServiceSpec", "type"): {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"},
    ("V1PersistentVolumeClaimSpec", "access_modes"):
        {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"},
    ("RbacV1Subject", "kind"): {"User", "Group", "ServiceAccount"},
    ("V1RoleRef", "kind"): {"Role", "ClusterRole"},
    ("V1DeploymentStrategy", "type"): {"Recreate", "RollingUpdate"},
}
_QUANTITY_MAPS = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"),
                  ("V1VolumeResourceRequirements", "limits"),
                  ("V1VolumeResourceRequirements", "requests")}
_PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,),
                                            "float": (int, float), "object": (object,)}


def model_name(api_version: str, kind: str) -> str | None:
    """The `kubernetes.client` model class for apiVersion/kind, or None for a CRD."""
    import kubernetes.client
    version = api_version.rpartition("/")[2]
    name = version[:1].upper() + version[1:] + kind
    return name if hasattr(kubernetes.client, name) else None


def _field_errors(data: Any, type_name: str, path: str, owner: tuple[str, str] | None
                  ) -> Iterator[str]:
    """Unknown keys, scalar type mismatches, bad quantities and enum values, recursively."""
    import kubernetes.client
    if data is None:
        return
    if type_name.startswith("list["):
        if not isinstance(data, list):
            yield f"{path}: expected a list, got {type(data).__name__}"
            return
        for i, item in enumerate(data):
            if owner in _ENUMS and item not in _ENUMS[owner]:
                yield f"{path}[{i}]: {item!r} is not one of {sorted(_ENUMS[owner])}"
            yield from _field_errors(item, type_name[5:-1], f"{path}[{i}]", None)
        return
    if type_name.startswith("dict["):
        if not isinstance(data, dict):
            yield f"{path}: expected a mapping, got {type(data).__name__}"
            return
        value_type = type_name[5:-1].split(", ", 1)[1]
        for key, value in data.items():
            if owner in _QUANTITY_MAPS:
                if not (isinstance(value, str) and _QUANTITY.match(value)):
                    yield f"{path}.{key}: {value!r} is not a quantity string (e.g. \"2\", \"512Mi\")"
                continue
            yield from _field_errors(value, value_type, f"{path}.{key}", None)
        return
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name])
        if type_name in ("int", "float") and isinstance(data, bool):
            ok = False
        if not ok:
            yield f"{path}: expected {type_name}, got {type(data).__name__} {data!r}"
        elif owner in _ENUMS and data not in _ENUMS[owner]:
            yield f"{path}: {data!r} is not one of {sorted(_ENUMS[owner])}"
        return
    if type_name in ("datetime", "date"):
        return
    model = getattr(kubernetes.client, type_name)
    if not isinstance(data, dict):
        yield f"{path}: expected a {type_name} mapping, got {type(data).__name__}"
        return
    by_json_key = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, value in data.items():
        attr = by_json_key.get(key)
        if attr is None:
            yield f"{path}.{key}: unknown field of {type_name}"
            continue
        yield from _field_errors(value, model.openapi_types[attr], f"{path}.{key}",
                                 (type_name, attr))


def check_as(data: Any, type_name: str, path: str = "") -> list[str]:
    """Problems of `data` read as the client model `type_name` (e.g. "V1Container")."""
    import kubernetes.client
    errors = list(_field_errors(data, type_name, path or type_name, None))
    config = kubernetes.client.Configuration()
    config.client_side_validation = True
    api = kubernetes.client.ApiClient(configuration=config)
    try:
        api._ApiClient__deserialize(data, type_name)
    except (ValueError, TypeError) as e:
        errors.append(f"{path or type_name}: {e}")
    return errors


def check_k8s_object(obj: Any) -> list[str]:
    """Problems of one Kubernetes object: against its client model, or structurally (CRDs)."""
    if not isinstance(obj, dict):
        return [f"not a mapping: {type(obj).__name__}"]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not api_version or not kind:
        return [f"missing apiVersion or kind: {sorted(obj)}"]
    where = f"{kind}/{(obj.get('metadata') or {}).get('name', '?')}"
    name = model_name(api_version, kind)
    if name is not None:
        return check_as(obj, name, where)
    errors = []
    if not isinstance(obj.get("metadata"), dict) or not obj["metadata"].get("name"):
        errors.append(f"{where}: metadata.name is missing")
    if not isinstance(obj.get("spec"), dict):
        errors.append(f"{where}: spec is missing")
    return errors


def load_yaml_docs(path: Path) -> list[Any]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_manifest_files() -> list[Path]:
    """Every Kubernetes YAML under infra/k8s that is not a kustomization."""
    return sorted(p for p in K8S.rglob("*.y*ml") if p.name != "kustomization.yaml")


def k8s_objects() -> list[tuple[Path, dict]]:
    return [(p, doc) for p in k8s_manifest_files() for doc in load_yaml_docs(p)]


def read_profile(name: str) -> dict[str, Any]:
    return json.loads((PROFILES / f"config_{name}.json").read_text())


def read_versions() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "versions.yaml").read_text())


@pytest.fixture(scope="session")
def versions() -> dict[str, Any]:
    return read_versions()


@pytest.fixture(scope="session")
def kubernetes_profile() -> dict[str, Any]:
    return read_profile("kubernetes")
