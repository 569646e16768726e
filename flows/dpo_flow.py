"""Direct preference optimization as a Metaflow flow: prepare -> train -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the preference pairs (prompt shared, loss masks on the responses)
    train     Ray trainer actors (FSDP2 over gloo/NCCL): reference log-probs once, DPO steps
              with checkpoints every K steps, HF export; @metaflow_ray over `run.num_nodes`
    join      collect the control task's results
    evaluate  the DPO suite (`steps/evaluate.py`): held-out implicit-reward accuracy and margin
              of the exported policy against the starting model
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/dpo_flow.py run                                   # tiny CPU run
    python flows/dpo_flow.py --config config my_dpo.yaml run       # model.hf_dir: an SFT export
    python flows/dpo_flow.py resume train                          # continue from the checkpoint

The reward model has its own recipe (`steps/train_reward.py`); it shares the data and the
driver loop with this flow's train step.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import Config, card, current, retry, step

DPO_SCHEMA = "posttrain.config.dpo.DPOConfig"


@ship_repo("lib", "steps", "configs", "assets")
class DPOFlow(RecipeFlow):
    SCHEMA = DPO_SCHEMA
    config = Config("config", default="configs/dpo/tiny.yaml", parser=parse_config(DPO_SCHEMA))

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def train(self):
        """DPO from the prepared pairs (continuing from the newest checkpoint); export HF.

        Checkpoints and the reference log-probs live under the run's storage root, so a
        retried attempt and `resume train` find them.
        """
        from _posttrain_flow import train_recipe, train_summary
        result = train_recipe("train_dpo", DPO_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "train", self.num_nodes, current.card["training"])
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.base_uri = result["base_model_uri"]
        self.checkpoint_uri = result["checkpoint_uri"]
        self.train_result = train_summary(result, "final_accuracy", "mean_pairs_per_s",
                                          "reference_pairs", "mean_completions_per_s",
                                          "reference_completions")     # the last two: KTO
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The DPO suite: held-out implicit-reward accuracy and margin of the exported policy
        against the starting model (its reference)."""
        from _posttrain_flow import evaluate_recipe
        result = evaluate_recipe("train_dpo", DPO_SCHEMA, self.config, self.hf_uri,
                                 self.base_uri, self.storage_root, current.card["evaluation"],
                                 provenance={"content_hash": self.content_hash})
        self.eval_table, self.eval_uri = result["table"], result["eval_uri"]
        self.eval_provenance = result["provenance"]
        self.heldout = next(iter(result["tasks"].values()))["model"]
        self.next(self.end)

    def lineage_outputs(self) -> dict:
        return {**super().lineage_outputs(), "reference_uri": self.base_uri}

    def report_lines(self) -> list[str]:
        lines = super().report_lines()
        return [lines[0], f"starting model: {self.base_uri}", *lines[1:]]


if __name__ == "__main__":
    DPOFlow()
