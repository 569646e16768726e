"""SFT -> GRPO -> evaluation chained in one flow, for a laptop or one machine.

    start     fix the run's storage
    sft       prepare the SFT data, train, export (the SFT recipe, e.g. arithmetic_tiny.yaml)
    grpo      prepare the prompts, GRPO from the SFT export, export
    evaluate  the evaluation suite: the GRPO model against the SFT model it started from
    end       the chain and the table

On a cluster the same chain runs as three deployed flows, each triggered by the previous one
finishing (`@trigger_on_finish` on GRPOFlow and EvalFlow); this flow is the local equivalent,
with every intermediate checkpoint an artifact of one run:

    python flows/pipeline_flow.py run
    python flows/pipeline_flow.py --config sft my_sft.yaml --config grpo my_grpo.yaml run
"""

from _posttrain_flow import build_config, parse_config, ship_repo
from metaflow import Config, FlowSpec, card, current, retry, step

SFT_SCHEMA = "posttrain.config.sft.SFTConfig"
GRPO_SCHEMA = "posttrain.config.grpo.GRPOConfig"
SUITE_SCHEMA = "posttrain.config.eval.SuiteConfig"


@ship_repo("lib", "steps", "configs", "assets")
class PipelineFlow(FlowSpec):
    sft = Config("sft", default="configs/sft/arithmetic_tiny.yaml", parser=parse_config(SFT_SCHEMA))
    grpo = Config("grpo", default="configs/grpo/tiny.yaml", parser=parse_config(GRPO_SCHEMA))
    suite = Config("suite", default="configs/eval/tiny.yaml", parser=parse_config(SUITE_SCHEMA))

    @step
    def start(self):
        """Fix the storage root of the whole chain."""
        from _posttrain_flow import check_inputs, storage_root
        for config, schema in ((self.sft, SFT_SCHEMA), (self.grpo, GRPO_SCHEMA)):
            check_inputs(config, schema)
        # under the SFT recipe's run.dir, keyed by flow and run (apart from SFTFlow's runs)
        self.storage_root = storage_root(self, self.sft.run.dir)
        print(f"storage: {self.storage_root}")
        self.next(self.train_sft)

    @retry(times=1)
    @step
    def train_sft(self):
        """Prepare and train the SFT recipe; export HF."""
        from _posttrain_flow import join, prepare_data, train_recipe
        root = join(self.storage_root, "sft")
        data = prepare_data(SFT_SCHEMA, self.sft, root)
        self.sft_prepared_uri, self.sft_content_hash = data.prepared_uri, data.content_hash
        self.sft_manifest_summary = data.manifest_summary
        result = train_recipe("train_sft", SFT_SCHEMA, self.sft, self.sft_prepared_uri, root,
                              "train")
        self.sft_hf_uri = result["hf_uri"]
        self.sft_result = {k: result.get(k) for k in (
            "steps", "started_at_step", "final_loss", "eval")}
        self.next(self.train_grpo)

    @retry(times=1)
    @step
    def train_grpo(self):
        """Prepare the prompts and run GRPO from the SFT export; export HF."""
        from _posttrain_flow import join, prepare_data, train_recipe
        root = join(self.storage_root, "grpo")
        data = prepare_data(GRPO_SCHEMA, self.grpo, root)
        self.grpo_prepared_uri, self.grpo_content_hash = data.prepared_uri, data.content_hash
        self.grpo_manifest_summary = data.manifest_summary
        result = train_recipe("train_grpo", GRPO_SCHEMA, self.grpo, self.grpo_prepared_uri,
                              root, "train", start_from=self.sft_hf_uri)
        self.hf_uri = result["hf_uri"]
        self.grpo_result = {k: result.get(k) for k in (
            "steps", "started_at_step", "final_reward_mean", "max_sync_diff", "baseline_eval",
            "eval")}
        self.next(self.evaluate)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The suite: the GRPO model against the SFT model it started from."""
        from _flow_cards import suite_card
        from _posttrain_flow import fetch, join, publish_json
        from steps import evaluate
        result = evaluate.run(build_config(SUITE_SCHEMA, self.suite), fetch(self.hf_uri),
                              fetch(self.sft_hf_uri))
        full = {**result.to_dict(), "model_uri": self.hf_uri, "baseline_uri": self.sft_hf_uri}
        self.eval_uri = publish_json(full, join(self.storage_root, "eval.json"))
        self.records = {t.name: t.records for t in result.tasks}
        self.eval_table = result.table()
        suite_card(current.card["evaluation"],
                   {**full, "tasks": {n: {k: v for k, v in t.items() if k != "records"}
                                      for n, t in full["tasks"].items()}}, self.records)
        print(evaluate.summarize(result))
        self.next(self.end)

    @card(type="blank", id="lineage")
    @step
    def end(self):
        """The chain and the table; the lineage (both datasets, all three configs)."""
        from _flow_cards import lineage_card, record_lineage
        from posttrain.lineage import dataset_ref
        datasets = [dataset_ref(prepared_uri=uri, content_hash=h,
                                config_hash=summary.get("config_hash", ""),
                                sources=summary.get("sources"))
                    for uri, h, summary in (
                        (self.sft_prepared_uri, self.sft_content_hash, self.sft_manifest_summary),
                        (self.grpo_prepared_uri, self.grpo_content_hash,
                         self.grpo_manifest_summary))]
        self.lineage = record_lineage(
            self, outputs={"sft_hf_uri": self.sft_hf_uri, "hf_uri": self.hf_uri,
                           "eval_uri": self.eval_uri},
            datasets=datasets, config={"sft": self.sft.to_dict(), "grpo": self.grpo.to_dict(),
                                       "suite": self.suite.to_dict()},
            started_from={"base_model_uri": self.sft.model.hf_dir})
        lineage_card(current.card["lineage"], self.lineage)
        print(f"SFT:  {self.sft_hf_uri} (data {self.sft_content_hash[:12]})\n"
              f"GRPO: {self.hf_uri} (prompts {self.grpo_content_hash[:12]})\n"
              f"eval: {self.eval_uri}")
        for row in self.eval_table:
            print(f"  {row['task']:<24}{row['metric']:<28}{row['model']:>10.4g}"
                  f"{row['baseline']:>10.4g}{row['delta']:>+10.4g}")


if __name__ == "__main__":
    PipelineFlow()
