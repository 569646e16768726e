"""A Bradley-Terry reward model as a Metaflow flow: prepare -> train -> evaluate.

    start     resolve where this run keeps its data, checkpoints and weights
    prepare   tokenize the preference pairs (prompt shared, loss masks on the responses)
    train     Ray trainer actors (FSDP2): the LM body with a scalar head, Bradley-Terry loss,
              checkpoints every K steps; exports the body + reward_head.safetensors
    join      collect the control task's results
    evaluate  held-out pair accuracy of the exported model, scored the way GRPO will load it
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

    python flows/reward_flow.py run                                # tiny CPU run
    python flows/reward_flow.py --config config my_rm.yaml run     # model.hf_dir: an SFT export

Load the result as a GRPO reward with `posttrain.train.reward.load_reward_model(<model dir>)`.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow, eval_rows
from metaflow import Config, card, current, retry, step

REWARD_SCHEMA = "posttrain.config.reward.RewardConfig"


@ship_repo("lib", "steps", "configs", "assets")
class RewardFlow(RecipeFlow):
    SCHEMA = REWARD_SCHEMA
    config = Config("config", default="configs/reward/tiny.yaml",
                    parser=parse_config(REWARD_SCHEMA))

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def train(self):
        """Bradley-Terry training (continuing from the newest checkpoint); export the model."""
        from _posttrain_flow import train_recipe, train_summary
        result = train_recipe("train_reward", REWARD_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "train", self.num_nodes, current.card["training"])
        self.model_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        self.checkpoint_uri = result["checkpoint_uri"]
        self.train_result = train_summary(result, "final_accuracy", "mean_pairs_per_s")
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The reward-model suite: held-out pairs scored by the exported model, loaded as a
        GRPO reward would load it (no baseline: the starting model has no reward head)."""
        from _posttrain_flow import evaluate_recipe
        result = evaluate_recipe("train_reward", REWARD_SCHEMA, self.config, self.model_uri,
                                 None, self.storage_root, current.card["evaluation"],
                                 provenance={"content_hash": self.content_hash})
        self.eval_table, self.eval_uri = result["table"], result["eval_uri"]
        self.eval_provenance = result["provenance"]
        task = next(iter(result["tasks"].values()))
        self.heldout = {**task["model"], "pairs": task["num_samples"]}
        self.next(self.end)

    def lineage_outputs(self) -> dict:
        return {"model_uri": self.model_uri, "checkpoint_uri": self.checkpoint_uri,
                "eval_uri": self.eval_uri}

    def report_lines(self) -> list[str]:
        return [f"reward model: {self.model_uri}", f"checkpoints: {self.checkpoint_uri}",
                f"eval: {self.eval_uri}", f"dataset hash: {self.content_hash}",
                *eval_rows(self.eval_table)]


if __name__ == "__main__":
    RewardFlow()
