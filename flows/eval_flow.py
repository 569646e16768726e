"""Evaluation as a Metaflow flow: a model against a baseline on a suite of tasks.

    start     resolve both checkpoints: the export (`hf_uri`) of a finished run given by
              pathspec (`--model-run SFTFlow/1234`), or a directory (`--model-dir`); the same
              for the baseline
    evaluate  every task of the suite (held-out loss, graded generation, preference accuracy,
              RL rewards) on both checkpoints; the comparison table, the per-sample records,
              the full result as JSON in the run's storage, and a card with tables and a chart
    end       record the lineage (the suite's data hashes, its config hash, the runs of both
              checkpoints, code version), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/sft_flow.py --config config configs/sft/arithmetic_tiny.yaml run
    python flows/eval_flow.py run --model-run SFTFlow/<run id> \\
        --baseline-dir runs/SFTFlow/<run id>/train/base_model
    python flows/eval_flow.py --config suite my_suite.yaml run --model-run GRPOFlow/<id> \\
        --baseline-run SFTFlow/<id>
    python flows/eval_flow.py card server                       # the evaluation card

Deployed with `argo-workflows create`, the flow runs whenever a GRPOFlow run finishes
(`@trigger_on_finish`): that run's export against the checkpoint it started from.

The suite is validated against its schema when the flow is launched: an unknown key fails
before any step runs. Generation uses the suite's rollout engine (native on CPU, vLLM on GPU).
"""

from _posttrain_flow import build_config, parse_config, ship_repo
from metaflow import Config, FlowSpec, Parameter, card, current, step, trigger_on_finish

SUITE_SCHEMA = "posttrain.config.eval.SuiteConfig"


@trigger_on_finish(flow="GRPOFlow")
@ship_repo("lib", "steps", "configs", "assets")
class EvalFlow(FlowSpec):
    suite = Config("suite", default="configs/eval/tiny.yaml", parser=parse_config(SUITE_SCHEMA))
    model_run = Parameter("model-run", default="",
                          help="pathspec of a finished run (e.g. SFTFlow/1234) whose exported "
                               "checkpoint (`hf_uri`) to evaluate")
    model_dir = Parameter("model-dir", default="", help="or: the checkpoint's directory / URI")
    baseline_run = Parameter("baseline-run", default="",
                             help="pathspec of a finished run whose export is the baseline")
    baseline_dir = Parameter("baseline-dir", default="",
                             help="or: the baseline checkpoint's directory / URI")
    run_dir = Parameter("run-dir", default="runs/eval",
                        help="where the result JSON goes (local directory or s3:// prefix)")

    @step
    def start(self):
        """Resolve the model and the baseline (run pathspec or directory), and the storage."""
        from _flow_runs import resolve_checkpoint
        from _posttrain_flow import storage_root
        self.storage_root = storage_root(self, self.run_dir)
        model_run, baseline_run, baseline_dir = self.model_run, self.baseline_run, \
            self.baseline_dir
        trigger = getattr(current, "trigger", None)
        if trigger and not (model_run or self.model_dir):
            # deployed, a finished GRPOFlow run triggers this flow: its export against the
            # checkpoint it started from
            model_run = trigger.run.pathspec
            if not (baseline_run or baseline_dir):
                baseline_dir = trigger.run.data.base_model_uri
        self.model_uri, self.model_parent = resolve_checkpoint("model", model_run,
                                                               self.model_dir)
        self.baseline_uri, self.baseline_parent = resolve_checkpoint(
            "baseline", baseline_run, baseline_dir)
        print(f"model: {self.model_uri} ({self.model_parent or 'directory'})\n"
              f"baseline: {self.baseline_uri} ({self.baseline_parent or 'directory'})")
        self.next(self.evaluate)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """Run the suite on both checkpoints; keep the table, the records and the JSON's URI."""
        from _flow_cards import suite_card
        from _posttrain_flow import fetch, join, publish_json
        from steps import evaluate
        result = evaluate.run(build_config(SUITE_SCHEMA, self.suite),
                              fetch(self.model_uri), fetch(self.baseline_uri))
        full = {**result.to_dict(), "model_uri": self.model_uri,
                "baseline_uri": self.baseline_uri, "model_run": self.model_parent,
                "baseline_run": self.baseline_parent}
        self.eval_uri = publish_json(full, join(self.storage_root, "eval.json"))
        self.records = {t.name: t.records for t in result.tasks}       # per-sample tables
        self.suite_result = {**full, "tasks": {name: {k: v for k, v in task.items()
                                                      if k != "records"}
                                               for name, task in full["tasks"].items()}}
        self.eval_table = result.table()
        suite_card(current.card["evaluation"], self.suite_result, self.records)
        print(evaluate.summarize(result))
        self.next(self.end)

    @card(type="blank", id="lineage")
    @step
    def end(self):
        """Record what the result came from (lineage artifact, run tags, card); print the table."""
        from _flow_cards import lineage_card, record_lineage
        from posttrain.lineage import raw_dataset_ref
        self.lineage = record_lineage(
            self, config=self.suite.to_dict(), outputs={"eval_uri": self.eval_uri},
            datasets=[raw_dataset_ref(t["name"], t["data"]["path"]) for t in self.suite.tasks],
            parents=[p for p in dict.fromkeys([self.model_parent, self.baseline_parent]) if p],
            started_from={"model_uri": self.model_uri, "baseline_uri": self.baseline_uri})
        lineage_card(current.card["lineage"], self.lineage)
        print(f"model: {self.model_uri}\nbaseline: {self.baseline_uri}\neval: {self.eval_uri}")
        for row in self.eval_table:
            print(f"  {row['task']:<24}{row['metric']:<28}{row['model']:>10.4g}"
                  f"{row['baseline']:>10.4g}{row['delta']:>+10.4g}")


if __name__ == "__main__":
    EvalFlow()
