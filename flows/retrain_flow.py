"""Scheduled retraining with a promotion gate: newest snapshot -> SFT -> evaluate -> promote?

    start     find the newest complete data snapshot; point the SFT recipe at it
    prepare   tokenize the snapshot into shards
    train     the SFT recipe (checkpoints every K steps, HF export)
    evaluate  the candidate and the currently promoted model (the newest run of this flow tagged
              `promoted`) on the snapshot's held-out split, then the gate
              (`posttrain.promotion.decide`): promote only if better by the margin
    end       move the `promoted` tag (or leave it) and say why

Deployed with `python flows/retrain_flow.py --datastore=s3 argo-workflows create`, it runs on the
`@schedule` below; locally, `python flows/retrain_flow.py run` runs it once.
"""

from _posttrain_flow import parse_config, ship_repo
from metaflow import Config, FlowSpec, card, current, retry, schedule, step

RETRAIN_SCHEMA = "posttrain.retrain.RetrainConfig"
SFT_SCHEMA = "posttrain.config.sft.SFTConfig"
PROMOTED = "promoted"


@schedule(daily=True)
@ship_repo("lib", "steps", "configs", "assets")
class RetrainFlow(FlowSpec):
    config = Config("config", default="configs/retrain/tiny.yaml",
                    parser=parse_config(RETRAIN_SCHEMA))

    @step
    def start(self):
        """The newest snapshot, and the SFT recipe pointed at it (validated here)."""
        from _posttrain_flow import build_config, storage_root
        from posttrain.config.loader import to_dict
        from posttrain.config.recipes import load_recipe
        from posttrain.retrain import newest_snapshot
        from posttrain.train.sft import SFTConfig
        cfg = build_config(RETRAIN_SCHEMA, self.config)
        self.snapshot = newest_snapshot(cfg.snapshots)
        recipe = load_recipe(cfg.recipe, SFTConfig, {
            "data.train": [{"name": "snapshot", "path": self.snapshot["train"]}],
            "data.eval": [{"name": "snapshot", "path": self.snapshot["eval"]}]})
        self.recipe = to_dict(recipe)
        self.storage_root = storage_root(self, recipe.run.dir)
        print(f"snapshot {self.snapshot['name']} (sha256 {self.snapshot['sha256'][:12]}); "
              f"storage {self.storage_root}")
        self.next(self.prepare)

    @step
    def prepare(self):
        """Tokenize the snapshot into shards."""
        from _posttrain_flow import prepare_data
        out = prepare_data(SFT_SCHEMA, self.recipe, self.storage_root)
        self.prepared_uri, self.content_hash = out.prepared_uri, out.content_hash
        self.manifest_summary = out.manifest_summary
        self.next(self.train)

    @retry(times=1)
    @step
    def train(self):
        """Train the candidate (continuing from the newest checkpoint on a retry); export HF."""
        from _posttrain_flow import train_recipe
        result = train_recipe("train_sft", SFT_SCHEMA, self.recipe, self.prepared_uri,
                              self.storage_root, "train")
        self.hf_uri = result["hf_uri"]
        self.train_result = {k: result.get(k) for k in ("steps", "started_at_step",
                                                        "final_loss", "eval")}
        self.next(self.evaluate)

    @card(type="blank", id="promotion")
    @step
    def evaluate(self):
        """Candidate vs the promoted model on this snapshot's held-out split; the gate."""
        from metaflow.cards import Markdown, Table

        import dataclasses

        from _flow_runs import promoted_run

        from _posttrain_flow import build_config, fetch
        from posttrain.promotion import decide
        from steps import evaluate, train_sft
        gate = build_config(RETRAIN_SCHEMA, self.config).gate
        sft = build_config(SFT_SCHEMA, self.recipe)
        # the SFT recipe's suite (its first held-out source), without generated answers
        suite = train_sft.RECIPE.eval_suite(sft, {})
        suite = dataclasses.replace(suite, tasks=(dataclasses.replace(suite.tasks[0],
                                                                      samples=None,
                                                                      generation=None),))
        previous = promoted_run(current.flow_name, PROMOTED, exclude=current.run_id)
        self.baseline_run = previous.pathspec if previous else None
        result = evaluate.run(suite, fetch(self.hf_uri),
                              fetch(previous.data.hf_uri) if previous else None)
        task = result.tasks[0]

        def metrics(values: dict[str, float]) -> dict[str, float]:
            return {"eval_loss": values["loss"], "eval_perplexity": values["perplexity"]}

        self.candidate_metrics = metrics(task.model)
        self.baseline_metrics = metrics(task.baseline) if previous else None
        d = decide(gate, self.candidate_metrics, self.baseline_metrics)
        self.decision = {"promote": d.promote, "reason": d.reason, "metric": gate.metric,
                         "candidate": d.candidate, "baseline": d.baseline,
                         "improvement": d.improvement, "baseline_run": self.baseline_run}
        card_ = current.card["promotion"]
        card_.append(Markdown(f"# Promotion: {'promoted' if d.promote else 'not promoted'}\n\n"
                              f"{d.reason}"))
        rows = [[k, round(v, 4), "" if self.baseline_metrics is None
                 else round(self.baseline_metrics[k], 4)]
                for k, v in self.candidate_metrics.items()]
        card_.append(Table(rows, headers=["metric", "candidate",
                                          f"promoted ({self.baseline_run or 'none'})"]))
        print(d.reason)
        self.next(self.end)

    @card(type="blank", id="lineage")
    @step
    def end(self):
        """Move the `promoted` tag to this run if the gate said so; record the lineage."""
        from metaflow import Run

        from _flow_cards import lineage_card, record_lineage
        self.lineage = record_lineage(
            self, outputs={"hf_uri": self.hf_uri}, config={
                "retrain": self.config.to_dict(), "recipe": self.recipe},
            started_from={"base_model_uri": self.recipe["model"].get("hf_dir"),
                          "snapshot": self.snapshot})
        lineage_card(current.card["lineage"], self.lineage)
        if self.decision["promote"]:
            current.run.add_tags([PROMOTED])
            if self.baseline_run:
                Run(self.baseline_run).remove_tag(PROMOTED)
            print(f"promoted {current.flow_name}/{current.run_id} "
                  f"(was {self.baseline_run or 'none'})")
        else:
            print(f"kept {self.baseline_run}: {self.decision['reason']}")


if __name__ == "__main__":
    RetrainFlow()
