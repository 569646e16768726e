"""Lineage of a real chain of runs, through Metaflow's Runner and client:

    SFTFlow (arithmetic chats, a few steps) -> GRPOFlow --sft-run SFTFlow/<id>
        -> EvalFlow --model-run GRPOFlow/<id> --baseline-run SFTFlow/<id>

Each run's `lineage` artifact must name its datasets by content hash (a recipe run's: the
prepare step's hash; the eval run's: the hash of its suite's data files) and its config by
the hash of the resolved config; each run's parents must be the runs it started from; the
runs carry the dataset/config/model/parent tags (and the client filters on them);
`posttrain lineage <run>` prints the chain as a tree; the end step's lineage card shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import GRPO_FLOW, REPO, card_components

EVAL_FLOW = REPO / "flows" / "eval_flow.py"
TINY_SUITE = REPO / "configs" / "eval" / "tiny.yaml"

NO_LINEAGE_FLOW = '''
from metaflow import FlowSpec, step
class NoLineageFlow(FlowSpec):
    @step
    def start(self):
        self.next(self.end)
    @step
    def end(self):
        pass
if __name__ == "__main__":
    NoLineageFlow()
'''


def _resolved_config(schema: str, path) -> dict:
    sys.path.insert(0, str(REPO / "flows"))
    from _posttrain_flow import parse_config
    return parse_config(schema)(path.read_text())


def _lineage_cli(sandbox, *args: str, as_root: bool = False) -> subprocess.CompletedProcess:
    """`posttrain lineage ARGS`; `as_root`: as root in a container is, with no user name
    Metaflow can default its namespace to (USER=root, no METAFLOW_USER)."""
    env = {**os.environ, **sandbox.env}
    if as_root:
        env = {k: v for k, v in env.items()
               if k not in ("METAFLOW_USER", "SUDO_USER", "USERNAME")} | {"USER": "root"}
    return subprocess.run([sys.executable, "-m", "steps.cli", "lineage", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def _check_run_lineage(run, schema: str, config_path) -> dict:
    """What every recipe run's lineage must say, checked against the run's own artifacts."""
    from posttrain.lineage import config_hash
    lin = run.data.lineage
    prepare = run["prepare"].task.data
    assert lin["pathspec"] == run.pathspec
    [dataset] = lin["datasets"]
    assert dataset["content_hash"] == prepare.content_hash
    assert dataset["config_hash"] == prepare.manifest_summary["config_hash"]
    assert dataset["prepared_uri"] == prepare.prepared_uri
    sources = {(s["split"], s["name"]): s for s in dataset["sources"]}
    assert {split for split, _ in sources} == {"train", "eval"}
    assert all(s["path"].startswith("assets/data/") and len(s["content_hash"]) == 64
               for s in sources.values())
    # the config hash is the hash of the resolved config: the flow's parser on the same YAML
    resolved = _resolved_config(schema, config_path)
    assert lin["config"] == resolved
    assert lin["config_hash"] == config_hash(resolved)
    assert lin["config"] == run["evaluate"].task.data.eval_provenance["config"]
    # the code that ran: this checkout's commit
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert lin["code"]["kind"] == "git" and lin["code"]["commit"] == head
    # every produced artifact is listed, and traces back to this record
    end = run["end"].task.data
    assert lin["outputs"]["hf_uri"] == end.hf_uri and lin["outputs"]["eval_uri"] == end.eval_uri
    stored = json.loads(open(os.path.join(end.storage_root, "lineage.json")).read())
    assert stored == lin
    tags = set(run.tags)
    assert {f"dataset:{prepare.content_hash[:12]}", f"config:{lin['config_hash'][:12]}",
            f"model:{run.pathspec}"} <= tags
    return lin


@pytest.mark.slow
def test_lineage_of_an_sft_then_grpo_chain(arithmetic_chain, monkeypatch, tmp_path):
    """The lineage of the chain's runs (tests/flows/conftest.py), then of an EvalFlow run of
    the GRPO export against the SFT export."""
    from metaflow import Flow, Runner, namespace
    sandbox, sft, grpo = arithmetic_chain.sandbox, arithmetic_chain.sft, arithmetic_chain.grpo
    monkeypatch.setenv("USER", sandbox.env["USER"])
    for key, value in sandbox.env.items():      # the client in this process reads them
        monkeypatch.setenv(key, value)
    sft_lin = _check_run_lineage(sft, "posttrain.train.sft.SFTConfig",
                                 arithmetic_chain.sft_config)
    assert sft_lin["parents"] == [] and sft_lin["started_from"] == {}
    lin = _check_run_lineage(grpo, "posttrain.train.grpo.GRPOConfig",
                             arithmetic_chain.grpo_config)
    assert lin["parents"] == [sft.pathspec]
    assert lin["started_from"] == {"base_model_uri": sft.data.hf_uri,
                                   "parent_run": sft.pathspec}
    assert f"parent:{sft.pathspec}" in grpo.tags
    # the tags are what the Metaflow UI and client filter on
    namespace(None)
    # (other GRPO runs in this sandbox may start from the same SFT run: tests/flows/
    # test_grpo_flow.py finds it by its config; every run the tag lists does start from it)
    children = list(Flow("GRPOFlow").runs(f"parent:{sft.pathspec}"))
    assert grpo.pathspec in [r.pathspec for r in children]
    assert all(r["end"].task.data.lineage["parents"] == [sft.pathspec] for r in children)
    assert [r.pathspec for r in Flow("SFTFlow").runs(
        f"dataset:{sft_lin['datasets'][0]['content_hash'][:12]}")] == [sft.pathspec]

    # the lineage card of the GRPO run's end step draws both runs
    # read the way docs/lineage.md says: the card CLI (this process's Metaflow config was
    # fixed at import, before the sandbox's card root was set)
    html_path = tmp_path / "lineage-card.html"
    got = subprocess.run(
        [sys.executable, str(GRPO_FLOW), "card", "get", f"{grpo.id}/end", "--id",
         "lineage", str(html_path)], cwd=REPO, env={**os.environ, **sandbox.env},
        capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    components = card_components(html_path.read_text())
    text = json.dumps(components)
    tree = next(c for c in components if c["type"] == "markdown" and "└─" in c["source"])
    assert f"```\n{grpo.pathspec} (dataset " in tree["source"]
    assert f"└─ {sft.pathspec} (dataset {sft_lin['datasets'][0]['content_hash'][:12]}" \
        in tree["source"]
    table = next(c for c in components if c["type"] == "table")
    assert [row[0] for row in table["data"]] == [grpo.pathspec, sft.pathspec]
    assert any(c["type"] == "vegaChart" for c in components)
    assert lin["config_hash"][:12] in text and sft_lin["config_hash"][:12] in text

    # `posttrain lineage` walks the chain through the Metaflow client
    out = _lineage_cli(sandbox, grpo.pathspec)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"{grpo.pathspec} (dataset {lin['datasets'][0]['content_hash'][:12]}, "
                        f"config {lin['config_hash'][:12]}, code {lin['code']['commit'][:7]}"
                        f"{'+dirty' if lin['code']['dirty'] else ''})")
    sft_line = next(i for i, line in enumerate(lines) if line.startswith(f"└─ {sft.pathspec} "))
    assert f"dataset {sft_lin['datasets'][0]['content_hash'][:12]}" in lines[sft_line]
    assert f"config {sft_lin['config_hash'][:12]}" in lines[sft_line]
    assert f"   └─ eval_uri: {sft_lin['outputs']['eval_uri']}" in lines[sft_line + 1:]
    as_json = json.loads(_lineage_cli(sandbox, grpo.pathspec, "--json").stdout)
    assert as_json["parents"][0]["lineage"] == sft_lin
    # no user name for Metaflow's default namespace (root in a container): the same tree,
    # not MetaflowUnknownUser's traceback
    as_root = _lineage_cli(sandbox, grpo.pathspec, as_root=True)
    assert (as_root.returncode, as_root.stdout) == (0, out.stdout), as_root.stderr[-2000:]

    _check_eval_lineage(sandbox, sft, grpo)

    # an unknown run and a run without lineage: one line, exit 2
    missing = _lineage_cli(sandbox, "SFTFlow/123")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().count("\n") == 0 and "SFTFlow/123" in missing.stderr
    bare = tmp_path / "no_lineage_flow.py"
    bare.write_text(NO_LINEAGE_FLOW)
    with Runner(str(bare), cwd=str(tmp_path), env=sandbox.env, show_output=False,
                pylint=False) as runner:
        old = runner.run().run
    no_lineage = _lineage_cli(sandbox, old.pathspec)
    assert no_lineage.returncode == 2
    assert no_lineage.stderr.strip().count("\n") == 0 and "no `lineage`" in no_lineage.stderr


def _files_hash(path: str) -> str:
    import hashlib
    digest = hashlib.sha256((REPO / path).read_bytes()).hexdigest()
    return hashlib.sha256(digest.encode()).hexdigest()


def _check_eval_lineage(sandbox, sft, grpo) -> None:
    """EvalFlow of the GRPO export against the SFT export: both runs are its parents, its
    datasets are its suite's files, and the tree reaches the SFT run through both."""
    import yaml
    from metaflow import Runner

    from posttrain.lineage import config_hash
    data = yaml.safe_load(TINY_SUITE.read_text())
    data["tasks"] = [t for t in data["tasks"] if t["kind"] in ("heldout_loss", "generation")][:2]
    for task in data["tasks"]:
        task["max_samples"] = 4
    suite = sandbox.root / "suite.yaml"
    suite.write_text(yaml.safe_dump(data, sort_keys=False))
    with Runner(str(EVAL_FLOW), cwd=str(REPO), env=sandbox.env, show_output=False,
                config=[("suite", str(suite))], pylint=False) as runner:
        ev = runner.run(model_run=grpo.pathspec, baseline_run=sft.pathspec,
                        run_dir=str(sandbox.root / "runs")).run
        assert ev.successful, ev
        lin = ev.data.lineage
        assert lin["parents"] == [grpo.pathspec, sft.pathspec]
        assert lin["started_from"] == {"model_uri": grpo.data.hf_uri,
                                       "baseline_uri": sft.data.hf_uri}
        resolved = _resolved_config("posttrain.eval.suites.SuiteConfig", suite)
        assert lin["config"] == resolved and lin["config_hash"] == config_hash(resolved)
        assert [d["content_hash"] for d in lin["datasets"]] == \
            [_files_hash(t["data"]["path"]) for t in data["tasks"]]
        assert lin["outputs"] == {"eval_uri": ev.data.eval_uri}
        tags = set(ev.tags)
        assert {f"parent:{grpo.pathspec}", f"parent:{sft.pathspec}",
                f"config:{lin['config_hash'][:12]}"} <= tags
        assert {f"dataset:{d['content_hash'][:12]}" for d in lin["datasets"]} <= tags
    out = _lineage_cli(sandbox, ev.pathspec, "--brief")
    assert out.returncode == 0, out.stderr
    h = {run.pathspec: run.data.lineage["config_hash"][:12] for run in (sft, grpo)}
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{ev.pathspec} (dataset ")
    assert lines[1].startswith(f"├─ {grpo.pathspec} (") and h[grpo.pathspec] in lines[1]
    assert lines[2].startswith(f"│  └─ {sft.pathspec} (") and h[sft.pathspec] in lines[2]
    assert lines[3].startswith(f"└─ {sft.pathspec} (") and lines[3].endswith("(shown above)")
    assert len(lines) == 4
