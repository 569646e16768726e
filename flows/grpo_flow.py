"""On-policy RL (GRPO, and PPO: the GRPO recipe with `algorithm.advantage: gae` and a critic) as a
Metaflow flow: prepare prompts -> grpo -> evaluate against the start.

    start     resolve the run's storage and the starting checkpoint: the export of another run
              given by pathspec (`--sft-run SFTFlow/1234`), or the config's model; when that is
              another run's output not on this disk (`model.produced_by`: the SFT config that
              makes it), the newest successful SFTFlow run of that config
    base      only when start found none of these: train that SFT base in this run
    prepare   tokenize the prompts (chat template with the generation prompt) into shards,
              keeping the dataset columns the rewards read (e.g. `answer`)
    grpo      the single controller over Ray trainer actors (FSDP2) and rollout engines (vLLM on
              GPUs, native on CPU): rollouts, rewards, advantages, updates, weight sync,
              checkpoints; over `run.num_nodes` machines with @metaflow_ray
    join      collect the control task's results
    evaluate  held-out reward and accuracy (greedy) of the trained checkpoint vs the start
    end       record the lineage (datasets and hashes, parent runs, config hash, code
              version, outputs), tag the run with it, draw it in a card; print

Run it (from the repository root):

    python flows/grpo_flow.py run                     # tiny CPU run: finds or trains its SFT base
    python flows/sft_flow.py --config config configs/sft/arithmetic_tiny.yaml run
    python flows/grpo_flow.py run --sft-run SFTFlow/<run id>       # start from that run
    python flows/grpo_flow.py --config config configs/ppo/tiny.yaml run   # PPO (a critic)
    python flows/grpo_flow.py --datastore=s3 --config config configs/grpo/qwen3_8b_2nodes.yaml \\
        run --with kubernetes --sft-run SFTFlow/<run id>
    python flows/grpo_flow.py resume grpo                          # continue from the checkpoint

Deployed with `argo-workflows create`, the flow runs whenever an SFTFlow run finishes
(`@trigger_on_finish`) and starts from that run's export.
"""

from _flow_ray import ray_nodes
from _posttrain_flow import parse_config, ship_repo
from _recipe_flow import RecipeFlow
from metaflow import (Config, Parameter, card, current, retry, step,
                      trigger_on_finish)

GRPO_SCHEMA = "posttrain.config.grpo.GRPOConfig"
SFT_SCHEMA = "posttrain.config.sft.SFTConfig"


@trigger_on_finish(flow="SFTFlow")
@ship_repo("lib", "steps", "configs", "assets")
class GRPOFlow(RecipeFlow):
    SCHEMA = GRPO_SCHEMA
    config = Config("config", default="configs/grpo/tiny.yaml", parser=parse_config(GRPO_SCHEMA))
    sft_run = Parameter("sft-run", default="",
                        help="pathspec of a finished run (e.g. SFTFlow/1234) whose exported "
                             "checkpoint (`hf_uri`) to start from, instead of config.model")

    @step
    def start(self):
        """Fix the storage root and the starting checkpoint (recorded as lineage)."""
        from _posttrain_flow import check_inputs, storage_root
        check_inputs(self.config, GRPO_SCHEMA)
        self.storage_root = storage_root(self, self.config.run.dir)
        self.num_nodes = int(self.config.run.num_nodes)
        self.parent_run, self.base_model_uri = None, self.config.model.hf_dir
        self.base_recipe = None                 # an SFT config for the base step to train
        # deployed (Argo), a finished SFTFlow run triggers this flow: start from its export
        trigger = getattr(current, "trigger", None)
        triggered = trigger.run.pathspec if trigger else None
        if self.sft_run or triggered:
            from metaflow import Run
            parent = Run(self.sft_run or triggered)
            if not parent.successful:
                raise ValueError(f"--sft-run {self.sft_run} did not finish successfully")
            self.parent_run, self.base_model_uri = parent.pathspec, parent.data.hf_uri
        elif self.base_model_uri:
            from _flow_runs import find_base_model
            self.parent_run, self.base_model_uri, self.base_recipe = find_base_model(
                self.config.model, SFT_SCHEMA)
        print(f"storage: {self.storage_root}; start from "
              f"{self.base_model_uri or 'a random model (config.model.init)'}"
              f"{f' ({self.parent_run})' if self.parent_run else ''}")
        self.next(self.base)

    @retry(times=1)
    @step
    def base(self):
        """Train the SFT base (`model.produced_by`) when start found neither its checkpoint
        nor a successful SFTFlow run of it; otherwise nothing."""
        if self.base_recipe is not None:
            from _posttrain_flow import join, prepare_data, train_recipe
            root = join(self.storage_root, "base")
            data = prepare_data(SFT_SCHEMA, self.base_recipe, root)
            result = train_recipe("train_sft", SFT_SCHEMA, self.base_recipe, data.prepared_uri,
                                  root, "train")
            self.base_model_uri = result["hf_uri"]
            print(f"trained the SFT base: {self.base_model_uri}")
        self.next(self.prepare)

    @step
    def prepare(self):
        """Tokenize the prompts into shards; keep the manifest's summary."""
        from _posttrain_flow import prepare_data
        (self.prepared_uri, self.content_hash, self.manifest_summary,
         self.shard_uris) = prepare_data(GRPO_SCHEMA, self.config, self.storage_root)
        self.next(self.grpo, num_parallel=self.num_nodes)

    @card(type="blank", id="training")
    @retry(times=1)
    @ray_nodes("config")
    @step
    def grpo(self):
        """Train with GRPO (continuing from the newest checkpoint); export HF.

        Checkpoints (weights, optimizer, prompt stream position) live under the run's storage
        root, so a retried attempt and `resume grpo` continue where the last one stopped.
        """
        from _posttrain_flow import join, publish, train_recipe, train_summary
        result = train_recipe("train_grpo", GRPO_SCHEMA, self.config, self.prepared_uri,
                              self.storage_root, "grpo", self.num_nodes,
                              current.card["training"], start_from=self.base_model_uri)
        self.hf_uri, self.metrics_uri = result["hf_uri"], result["metrics_uri"]
        if not self.base_model_uri:             # a random start: keep it for the comparison
            self.base_model_uri = publish(result["base_model_dir"],
                                          join(self.storage_root, "base_model"))
        self.checkpoint_uri = result["checkpoint_uri"]
        self.train_result = train_summary(result, "final_reward_mean",
                                          "mean_rollout_tokens_per_s", "max_sync_diff",
                                          "baseline_eval")
        self.next(self.join)

    @card(type="blank", id="evaluation")
    @step
    def evaluate(self):
        """The GRPO suite: held-out reward and accuracy of the trained checkpoint against the
        starting one (the run's evaluation sampling and reward functions)."""
        from _posttrain_flow import evaluate_recipe
        result = evaluate_recipe("train_grpo", GRPO_SCHEMA, self.config, self.hf_uri,
                                 self.base_model_uri, self.storage_root,
                                 current.card["evaluation"],
                                 provenance={"parent_run": self.parent_run,
                                             "content_hash": self.content_hash})
        self.eval_table, self.eval_uri = result["table"], result["eval_uri"]
        self.eval_provenance = result["provenance"]
        first = next(iter(result["tasks"].values()))
        self.eval_metrics, self.baseline_metrics = first["model"], first["baseline"]
        self.next(self.end)

    def lineage_start(self) -> tuple[dict, list]:
        return ({"base_model_uri": self.base_model_uri, "parent_run": self.parent_run},
                [self.parent_run])

    def report_lines(self) -> list[str]:
        return [f"Hugging Face checkpoint: {self.hf_uri}", f"checkpoints: {self.checkpoint_uri}",
                f"eval: {self.eval_uri}", f"started from: {self.base_model_uri}"
                f"{f' ({self.parent_run})' if self.parent_run else ''}",
                f"  {'metric':<28}{'start':>10}{'trained':>10}{'delta':>10}",
                *(f"  {row['metric']:<28}{row['baseline']:>10.4g}{row['model']:>10.4g}"
                  f"{row['delta']:>+10.4g}" for row in self.eval_table)]


if __name__ == "__main__":
    GRPOFlow()
