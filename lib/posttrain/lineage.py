"""Lineage: what produced a run's artifacts, and the chain of runs behind it.

Every recipe run records one `Lineage`: its pathspec (`SFTFlow/1733...`), the datasets it
read (source paths, the prepared dataset's content hash and the prepare config's hash, both
from the prepare manifest), the runs it started from (`parents`, Metaflow pathspecs), the
resolved config and its hash, the code version, and the artifacts it produced (`outputs`:
the exported model's URI, the eval report's URI, ...) with what the model was started from.

`walk` follows `parents` from run to run through a loader (the Metaflow client in
`steps/lineage.py`; anything that maps a pathspec to a stored lineage dict), `format_tree`
prints the result, `lineage_card_spec` turns it into what a card shows (a Markdown tree, a
table, a Vega-Lite graph), and `tags_for` gives the Metaflow tags (`dataset:<hash12>`,
`config:<hash12>`, `model:<flow>/<run id>`, `parent:<pathspec>`, `code:<version>`) that let
the Metaflow UI and client filter runs by dataset, config and model version.

No Metaflow here: the flows pass in what Metaflow knows (pathspec, code package).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from posttrain.errors import PosttrainError

SCHEMA_VERSION = 1
SHORT = 12                      # hex digits of a hash shown in tags and trees
# Metaflow's limits on user tags (metaflow/tagging_util.py): at most 50 per run, each a
# non-empty UTF-8 string of at most 500 characters. Lineage keeps room for a user's own tags.
MAX_TAG_CHARS = 500
MAX_LINEAGE_TAGS = 40
# The code is hashed from these directories when there is neither git nor a code package.
CODE_DIRS = ("lib", "steps", "flows")


class LineageError(PosttrainError):
    """A run is unknown, or has no lineage recorded."""


@dataclass(frozen=True)
class Lineage:
    """What produced one run's artifacts. `to_dict()` is what a flow stores as `lineage`."""

    pathspec: str                       # "SFTFlow/1733000000000000"
    datasets: list[dict[str, Any]]      # see `dataset_ref`
    parents: list[str]                  # pathspecs of the runs this one started from
    config: dict[str, Any]              # the resolved config (defaults filled in)
    config_hash: str                    # `config_hash(config)`
    code: dict[str, Any]                # `code_version(...)`
    outputs: dict[str, Any]             # artifact name -> URI (hf_uri, eval_uri, ...)
    started_from: dict[str, Any] = field(default_factory=dict)   # base_model_uri, parent_run
    resumed_from: str | None = None     # the origin run of a `resume`, which did part of the work
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def flow(self) -> str:
        return self.pathspec.split("/")[0]

    @property
    def run_id(self) -> str:
        return self.pathspec.split("/")[1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- hashing
def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and fixed separators: equal data gives equal text.

    Only JSON types are accepted (a tuple is a list); anything else is a `TypeError`, since
    its text form would not be stable.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def config_hash(cfg: Mapping[str, Any]) -> str:
    """sha256 (hex) of the config's canonical JSON: key order does not matter, values do."""
    return hashlib.sha256(canonical_json(dict(cfg)).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- code version
def code_version(repo_root: str | os.PathLike, package: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    """Which code ran: a git commit (+ dirty flag), else the shipped code package, else a hash.

    - `repo_root` a git checkout: `{"kind": "git", "commit", "dirty", "diff_hash"}`; a dirty
      tree also gets the hash of `git diff HEAD` and of the untracked files' names, so two
      runs from the same dirty tree compare equal.
    - else `package` (what Metaflow knows in a remote task: `{"sha": METAFLOW_CODE_SHA,
      "info": the package's INFO}`): `{"kind": "code-package", "sha", "commit", "dirty"}`,
      the commit being the one the package was built from, when it was built in a checkout.
    - else `{"kind": "tree", "sha"}`: sha256 over the `.py` files under lib/, steps/, flows/.
    """
    git = _git_version(str(repo_root))
    if git:
        return git
    if package and (package.get("sha") or (package.get("info") or {}).get("commit_sha")):
        info = package.get("info") or {}
        return {"kind": "code-package", "sha": package.get("sha"),
                "commit": info.get("commit_sha"), "dirty": info.get("has_uncommitted_changes")}
    return {"kind": "tree", "sha": tree_hash(str(repo_root))}


def _git(args: list[str], cwd: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                             check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_version(root: str) -> dict[str, Any] | None:
    if (_git(["rev-parse", "--is-inside-work-tree"], root) or "").strip() != "true":
        return None
    commit = (_git(["rev-parse", "HEAD"], root) or "").strip()
    if not commit:                      # a repository without commits
        return None
    status = _git(["status", "--porcelain"], root) or ""
    dirty = bool(status.strip())
    version: dict[str, Any] = {"kind": "git", "commit": commit, "dirty": dirty}
    if dirty:
        diff = _git(["diff", "HEAD", "--binary"], root) or ""
        untracked = sorted(line[3:] for line in status.splitlines() if line.startswith("??"))
        version["diff_hash"] = hashlib.sha256(
            (diff + "\0" + "\n".join(untracked)).encode()).hexdigest()
    return version


def tree_hash(root: str, dirs: Iterable[str] = CODE_DIRS) -> str:
    """sha256 over (relative path, content) of the `.py` files under `dirs` of `root`."""
    h = hashlib.sha256()
    for top in dirs:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                    h.update(f"{os.path.relpath(path, root)}\0{digest}\n".encode())
    return h.hexdigest()


def code_label(code: Mapping[str, Any]) -> str:
    """A short name for a code version: `b3061bb`, `b3061bb+dirty`, `pkg:1a2b...`, `tree:...`."""
    kind = code.get("kind")
    if kind == "git" or (kind == "code-package" and code.get("commit")):
        return code["commit"][:7] + ("+dirty" if code.get("dirty") else "")
    if kind == "code-package":
        return f"pkg:{str(code.get('sha'))[:SHORT]}"
    return f"tree:{str(code.get('sha'))[:SHORT]}"


# --------------------------------------------------------------------------- building
def dataset_ref(*, prepared_uri: str, content_hash: str, config_hash: str,
                sources: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One prepared dataset a run read.

    `content_hash` is the prepare manifest's hash of the tokenized shards, `config_hash` the
    manifest's hash of the prepare config; `sources` lists where the raw rows came from
    (`split`, `name`, `path` as configured, per-source `content_hash`, `rows`).
    """
    if not content_hash:
        raise ValueError(f"dataset {prepared_uri}: no content hash (was it prepared?)")
    return {"prepared_uri": prepared_uri, "content_hash": content_hash,
            "config_hash": config_hash, "sources": list(sources or [])}


def raw_dataset_ref(name: str, path: str | list[str]) -> dict[str, Any]:
    """A dataset read as it is, without a prepare step (an evaluation task's rows).

    `content_hash` is the sha256 over the sha256 of each file's bytes, in the order
    `expand_paths` lists them: it changes when any row changes, not when the files move.
    """
    import fsspec

    from posttrain.data.files import expand_paths
    files = expand_paths(path)
    digests = []
    for uri in files:
        h = hashlib.sha256()
        with fsspec.open(uri, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digests.append(h.hexdigest())
    content = hashlib.sha256("\n".join(digests).encode()).hexdigest()
    path = path if isinstance(path, str) else list(path)
    return {"prepared_uri": None, "content_hash": content, "config_hash": None,
            "sources": [{"split": "eval", "name": name, "path": path, "files": len(files),
                         "content_hash": content}]}


def check_pathspec(pathspec: str) -> str:
    """`Flow/run_id`, or a `LineageError` saying what a run pathspec looks like."""
    parts = str(pathspec).split("/")
    if len(parts) != 2 or not all(parts) or any(c.isspace() for c in pathspec):
        raise LineageError(f"{pathspec!r} is not a run pathspec: expected FlowName/RunID "
                           f"(e.g. SFTFlow/1733000000000000)")
    return pathspec


def build_lineage(pathspec: str, *, config: Mapping[str, Any], datasets: list[dict[str, Any]],
                  code: Mapping[str, Any], outputs: Mapping[str, Any],
                  parents: Iterable[str | None] = (), started_from: Mapping[str, Any] | None
                  = None, resumed_from: str | None = None) -> Lineage:
    """The lineage record of the run `pathspec` (None parents, e.g. no `--sft-run`, are dropped)."""
    check_pathspec(pathspec)
    parent_list = [check_pathspec(p) for p in parents if p]
    assert pathspec not in parent_list, f"{pathspec} cannot be its own parent"
    cfg = json.loads(canonical_json(dict(config)))      # a plain, JSON-safe copy
    return Lineage(
        pathspec=pathspec, datasets=[dict(d) for d in datasets], parents=parent_list,
        config=cfg, config_hash=config_hash(cfg), code=dict(code), outputs=dict(outputs),
        started_from={k: v for k, v in dict(started_from or {}).items() if v is not None},
        resumed_from=resumed_from,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# --------------------------------------------------------------------------- tags
def tags_for(lineage: Lineage | Mapping[str, Any]) -> list[str]:
    """Metaflow tags for a run: dataset, config, code and model versions, and its parents.

    `dataset:<hash12>` (one per dataset), `config:<hash12>`, `code:<label>`,
    `model:<flow>/<run id>` (when the run produced a model), `parent:<pathspec>`. Tags
    longer than Metaflow allows are dropped, and past `MAX_LINEAGE_TAGS` the rest, each with
    a warning: the `lineage` artifact itself is always complete.
    """
    d = lineage.to_dict() if isinstance(lineage, Lineage) else dict(lineage)
    tags = [f"dataset:{ds['content_hash'][:SHORT]}" for ds in d["datasets"]]
    tags.append(f"config:{d['config_hash'][:SHORT]}")
    tags.append(f"code:{code_label(d['code'])}")
    if any(k in d["outputs"] for k in ("hf_uri", "model_uri")):
        tags.append(f"model:{d['pathspec']}")
    tags += [f"parent:{p}" for p in d["parents"]]
    out: list[str] = []
    for tag in dict.fromkeys(tags):                     # dedupe, keep order
        if len(tag) > MAX_TAG_CHARS:
            warnings.warn(f"lineage tag dropped: longer than {MAX_TAG_CHARS} characters: "
                          f"{tag[:60]}...", stacklevel=2)
        elif len(out) == MAX_LINEAGE_TAGS:
            warnings.warn(f"lineage tags past the first {MAX_LINEAGE_TAGS} dropped "
                          f"(from {tag}); the lineage artifact lists them all", stacklevel=2)
            break
        else:
            out.append(tag)
    return out


# --------------------------------------------------------------------------- walking
Loader = Callable[[str], Mapping[str, Any]]


def walk(pathspec: str, load: Loader, *, root: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tree of runs behind `pathspec`, following `parents` through `load`.

    `load(pathspec)` returns a run's stored lineage dict or raises `LineageError` (unknown
    run, no lineage). A failure for `pathspec` itself propagates; a parent that cannot be
    loaded becomes a node with `error` set, so the rest of the tree still shows. `root`, when
    given, is used as `pathspec`'s lineage instead of loading it (a run's own end step).

    A node: `{"pathspec", "lineage" (dict or None), "error" (str or None), "seen" (bool: the
    run already appears elsewhere in the tree, not expanded again), "parents": [nodes]}`.
    """
    check_pathspec(pathspec)
    lineage = dict(root) if root is not None else dict(load(pathspec))
    return _node(pathspec, lineage, None, load, ancestors=(), expanded=set())


def _node(pathspec: str, lineage: dict | None, error: str | None, load: Loader,
          ancestors: tuple[str, ...], expanded: set[str]) -> dict[str, Any]:
    node: dict[str, Any] = {"pathspec": pathspec, "lineage": lineage, "error": error,
                            "seen": False, "parents": []}
    if lineage is None:
        return node
    if pathspec in expanded:
        node["seen"] = True
        return node
    expanded.add(pathspec)
    for parent in lineage.get("parents", []):
        if parent in ancestors or parent == pathspec:
            raise LineageError(f"lineage cycle: {parent} is its own ancestor via {pathspec}")
        try:
            parent_lineage, parent_error = dict(load(parent)), None
        except LineageError as e:
            parent_lineage, parent_error = None, str(e)
        node["parents"].append(_node(parent, parent_lineage, parent_error, load,
                                     (*ancestors, pathspec), expanded))
    return node


def iter_nodes(tree: Mapping[str, Any], depth: int = 0) -> Iterable[tuple[int, dict[str, Any]]]:
    """(depth, node) for every node of `tree`, parents after their child, depth first."""
    yield depth, dict(tree)
    for parent in tree["parents"]:
        yield from iter_nodes(parent, depth + 1)


# --------------------------------------------------------------------------- showing
def summary(node: Mapping[str, Any]) -> str:
    """`SFTFlow/3 (dataset 1a2b3c4d5e6f, config 9f8e7d6c5b4a, code b3061bb+dirty)`."""
    if node.get("error"):
        return f"{node['pathspec']} (no lineage: {node['error']})"
    lin = node["lineage"]
    data = ", ".join(f"dataset {d['content_hash'][:SHORT]}" for d in lin["datasets"]) or \
        "no dataset"
    seen = " (shown above)" if node.get("seen") else ""
    return (f"{node['pathspec']} ({data}, config {lin['config_hash'][:SHORT]}, "
            f"code {code_label(lin['code'])}){seen}")


def _details(lin: Mapping[str, Any]) -> list[str]:
    lines = []
    for d in lin["datasets"]:
        for s in d.get("sources", []):
            path = s.get("path")
            path = ", ".join(path) if isinstance(path, list) else path
            lines.append(f"data {s.get('split')}/{s.get('name')}: {path}")
        if d.get("prepared_uri"):
            lines.append(f"prepared: {d['prepared_uri']} (prepare config "
                         f"{(d.get('config_hash') or '')[:SHORT]})")
    for k, v in lin.get("started_from", {}).items():
        lines.append(f"started from {k}: {v}")
    if lin.get("resumed_from"):
        lines.append(f"resumed from: {lin['resumed_from']}")
    for k, v in lin.get("outputs", {}).items():
        lines.append(f"{k}: {v}")
    return lines


def format_tree(tree: Mapping[str, Any], *, details: bool = True) -> str:
    """The run and the runs behind it, one per line, as a unicode tree (parents indented).

    With `details`, each run also lists its data sources, prepared dataset, starting model
    and outputs.
    """
    lines = [summary(tree)]
    _format_children(tree, "", details, lines)
    return "\n".join(lines)


def _format_children(node: Mapping[str, Any], prefix: str, details: bool,
                     lines: list[str]) -> None:
    shown = node["lineage"] is not None and not node.get("seen")
    items: list[tuple[str, Any]] = [("text", t) for t in (_details(node["lineage"])
                                                          if details and shown else [])]
    items += [("node", p) for p in node["parents"]]
    for i, (kind, item) in enumerate(items):
        last = i == len(items) - 1
        branch, extend = ("└─ ", "   ") if last else ("├─ ", "│  ")
        if kind == "text":
            lines.append(prefix + branch + item)
        else:
            lines.append(prefix + branch + summary(item))
            _format_children(item, prefix + extend, details, lines)


def lineage_rows(tree: Mapping[str, Any]) -> list[list[str]]:
    """One table row per run: run, datasets, config, code, parents, model."""
    rows = []
    for _, node in iter_nodes(tree):
        lin = node["lineage"]
        if node.get("seen"):
            continue
        if lin is None:
            rows.append([node["pathspec"], f"no lineage: {node['error']}", "", "", "", ""])
            continue
        outputs = lin.get("outputs", {})
        rows.append([
            node["pathspec"],
            ", ".join(d["content_hash"][:SHORT] for d in lin["datasets"]),
            lin["config_hash"][:SHORT],
            code_label(lin["code"]),
            ", ".join(lin["parents"]) or "-",
            str(outputs.get("hf_uri") or outputs.get("model_uri") or "-"),
        ])
    return rows


LINEAGE_HEADERS = ["run", "dataset", "config", "code", "parents", "model"]


def lineage_graph(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A Vega-Lite graph of the runs: the run on the left, the runs it started from to its
    right, one row per run, an edge from each run to each of its parents."""
    nodes, edges, row_of = [], [], {}
    for depth, node in iter_nodes(tree):
        if node["pathspec"] in row_of:
            continue
        row_of[node["pathspec"]] = len(nodes)
        lin = node["lineage"]
        detail = (f"data {', '.join(d['content_hash'][:8] for d in lin['datasets']) or '-'}"
                  f" · config {lin['config_hash'][:8]} · code {code_label(lin['code'])}"
                  if lin else "no lineage")
        nodes.append({"run": node["pathspec"], "detail": detail, "depth": depth,
                      "row": len(nodes)})
    for _, node in iter_nodes(tree):
        for parent in node["parents"]:
            a, b = nodes[row_of[node["pathspec"]]], nodes[row_of[parent["pathspec"]]]
            edges.append({"x": a["depth"], "y": a["row"], "x2": b["depth"], "y2": b["row"]})
    depth_max = max(1, max(n["depth"] for n in nodes))
    x = {"field": "depth", "type": "quantitative", "axis": None,
         "scale": {"domain": [0, depth_max]}}
    y = {"field": "row", "type": "quantitative", "axis": None,
         "scale": {"domain": [-0.5, len(nodes) - 0.5], "reverse": True}}
    # the labels run past the plot on the right; Vega's default autosize ("pad") makes room
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": "lineage (each run points to the runs it started from)",
        "width": 300 * depth_max, "height": 60 * len(nodes), "view": {"stroke": None},
        "layer": [
            {"data": {"values": edges}, "mark": {"type": "rule", "color": "#888"},
             "encoding": {"x": {**x, "field": "x"}, "y": {**y, "field": "y"},
                          "x2": {"field": "x2"}, "y2": {"field": "y2"}}},
            {"data": {"values": nodes}, "mark": {"type": "circle", "size": 160},
             "encoding": {"x": x, "y": y, "tooltip": [{"field": "run"}, {"field": "detail"}]}},
            {"data": {"values": nodes},
             "mark": {"type": "text", "align": "left", "dx": 10, "dy": -7, "fontWeight": "bold"},
             "encoding": {"x": x, "y": y, "text": {"field": "run"}}},
            {"data": {"values": nodes},
             "mark": {"type": "text", "align": "left", "dx": 10, "dy": 8, "fontSize": 10},
             "encoding": {"x": x, "y": y, "text": {"field": "detail"}}},
        ],
    }


def lineage_card_spec(tree: Mapping[str, Any]) -> dict[str, Any]:
    """What a lineage card shows, as data: a title, the tree as text, a table, a graph."""
    return {"title": f"Lineage of {tree['pathspec']}",
            "tree_text": format_tree(tree),
            "table": {"headers": LINEAGE_HEADERS, "rows": lineage_rows(tree)},
            "graph": lineage_graph(tree)}
