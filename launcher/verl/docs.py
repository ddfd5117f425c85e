"""docs/verl.md: the guide for verl users and the whole key table, generated from the table
(``fleetrl config docs --verl``, run by ``make docs``; a test holds the committed page to it)."""

from __future__ import annotations

from typing import Any

from launcher.verl.load import TABLE
from launcher.verl.table import NO_DEFAULT, Key, empty

GUIDE = """\
# Coming from verl

Generated from `launcher/verl/keys_*.py` by `fleetrl config docs --verl` (do not edit by
hand). A verl PPO or GRPO config runs on fleetrl as it is, with verl's meaning.

## Run your verl config

```bash
fleetrl check  --config verl_ppo.yaml                 # what this machine lacks, by verl key
fleetrl config show --config verl_ppo.yaml            # the fleetrl config it means
fleetrl train  --config verl_ppo.yaml actor_rollout_ref.actor.optim.lr=2e-6
fleetrl config from-verl verl_ppo.yaml --out fleetrl_ppo.yaml   # commented fleetrl YAML
```

`check`, `plan`, `train` and `config show` recognise verl's layout (`data`,
`actor_rollout_ref`, `critic`, `reward_model`, `custom_reward_function`, `algorithm`,
`trainer`, `global_profiler`, ...) in a file or in dotted overrides, with Hydra's `+key=v`;
a file may be a Hydra overlay (`defaults: [ppo_trainer, _self_]`). Whatever the file is
silent on takes verl's default (the table below), and interpolations (`${...}`,
`${oc.select:...}`, `${oc.env:...}`) resolve with OmegaConf as in verl. Then every key is:

- **mapped** to the fleetrl key that does what verl does with it;
- read by a **rule** with other keys (the GPU split, steps, warm-up, clip ratios,
  corrections, loggers: `launcher/verl/translate.py`);
- **no effect** here: a value other than verl's default is named once on stderr, with why;
- **refused**: a value fleetrl cannot honour stops the command with exit status 2 and one
  line per key, naming it and what to set instead (`actor_rollout_ref.rollout.name: hf`
  -> `sglang or vllm`); a key verl does not have is refused as verl's own config would.

fleetrl keys go beside the verl ones: in a `fleetrl:` section of the file, or as fleetrl
overrides on the command line (`learner.num_ranks=4`, `buffer.max_staleness=2`,
`trainer.output_dir=runs/x`); they apply last. A fleetrl error names the verl key it comes
from (`trainer.n_gpus_per_node, trainer.nnodes (fleetrl learner.gpus_per_rank): ...`).

## How the GPUs are split

verl's hybrid engine shares every GPU between training and rollout. fleetrl gives each its
own: the `trainer.n_gpus_per_node` x `trainer.nnodes` GPUs (less one reward server's
`reward_model.rollout.tensor_model_parallel_size`, unless `reward_model.enable_resource_pool`
gives it a pool of its own) go half to SGLang engines of
`actor_rollout_ref.rollout.tensor_model_parallel_size` GPUs each (whole engines, at least
one) and the rest to learner ranks of one GPU each. 8 GPUs with TP 2: 4 learner ranks and
2 engines. One GPU with TP 1 is shared: half each, weights over gloo. Set
`fleetrl.learner.num_ranks` or `fleetrl.rollout.num_engines` (or both) to split otherwise;
the other side gets what is left. Every command says the split it chose on stderr.

The split is decided before any size verl gives for all GPUs is divided: the deprecated
`actor_rollout_ref.actor.ppo_micro_batch_size` (a global micro-batch) becomes
`learner.micro_batch_size` = it / the data-parallel learner ranks (learner ranks /
`ulysses_sequence_parallel_size`), as verl divides it by its own; 8 GPUs and 64 give 16 per
rank over the 4 learner ranks. The other deprecated global sizes (`log_prob_micro_batch_size`,
the critic's, the reward model's) have no effect here and are named as such.

On a cluster (`trainer.nnodes` > 1, or `--address`), the learner ranks go to nodes marked
with Ray's custom resource `learner` and the engines to nodes marked `rollout` (verl's
nodes carry no marks): start each node with `ray start ... --resources='{"learner": 8}'`
or `'{"rollout": 8}'`, or one node with both, `'{"rollout": 4, "learner": 4}'`
(docs/cluster.md). `fleetrl check --address auto` says what each node lacks.

## What differs from verl

- **Rollouts are SGLang or vLLM servers** (`actor_rollout_ref.rollout.name: sglang` or
  `vllm`, vLLM 0.34.0 with its weight-transfer routes); HF and TensorRT-LLM rollouts are
  refused. On a CPU, `fleetrl.rollout.backend: embedded` runs
  fleetrl's embedded engine instead.
- **A reward model scores alone and raw, as verl**: with `reward_model.enable: true` verl
  trains on the model's score as it comes (its reward manager returns the model's scores
  and skips the rule function), so the run gets `reward.rule_weight: 0`,
  `reward.model.normalize: false` and `reward.model.clip: 0`. A `fleetrl:` section that
  sets them wins (`reward: {rule_weight: 1, model: {normalize: true, clip: 10}}` adds the
  rule score and OpenRLHF's normalisation).
- **Synchronous, as verl**: verl's trainer generates and trains in turn, so a verl config
  runs with `buffer.max_staleness: 0`. Set `fleetrl.buffer.max_staleness` (1-4) to overlap
  generation and training: that is what fleetrl is for.
- **Off-policy correction**: verl without `algorithm.rollout_correction` takes the
  recomputed logprobs as the old policy and weights nothing; fleetrl's default
  (`learner.correction.mode: decoupled`, AReaL's) also weights each token by
  π_old/π_rollout (capped at 5), which stale samples need. `rollout_is: token|sequence`
  maps to `token_tis|seq_tis`, `rollout_rs: token_k1` to `token_mis`, `bypass_mode` to
  `bypass`.
- **`loss_agg_mode: seq-mean-token-sum-norm`** is Dr. GRPO's loss here: the sequence mean
  of token sums over the constant `loss_scale_factor` (null: the maximum response length,
  verl's default). verl's actor sums over a micro-batch instead of averaging, so its value
  grows with the micro-batch size (it equals fleetrl's with one sequence per micro-batch);
  a learning rate tuned for it may need scaling.
- **`trainer.critic_warmup: N`**: verl updates the actor from global step N on, counting
  from 1, so N-1 steps train the critic alone; that is `learner.critic.warmup_steps: N-1`.
- **The critic trains on the policy's mini- and micro-batches**: `critic.ppo_mini_batch_size`,
  `ppo_epochs` and `use_dynamic_bsz` must equal the actor's (refused otherwise), and the
  actor's token budget (`ppo_max_token_len_per_gpu`) holds for both.
- **`data.truncation: error`** (verl's default) stops the run at start, naming the file and
  row of the first over-long prompt, not when a batch reaches it.
- **Steps**: `trainer.total_epochs` becomes epochs x (prompts // `data.train_batch_size`)
  when the run starts, counting the prompts as verl's dataloader does (the last partial
  batch dropped; `filter_overlong_prompts` filtered first).
- **Checkpoints** are fleetrl's (`<output_dir>/checkpoints/step_N`, everything to resume
  exactly); verl checkpoints cannot be loaded. `trainer.default_local_dir` is the run
  directory. `trainer.save_freq: -1` never saves, as in verl. `resume_mode: resume_path`
  with `resume_from_path` starts from a fleetrl checkpoint (`trainer.resume_from_path`).
- **`trainer.val_before_train`** validates once before the first step, not again when a run
  resumes.
- **Warm-up** starts at 1/warm-up steps of the learning rate, not at 0.
- **Metrics** carry verl's names where verl has them (`actor/pg_loss`, `actor/entropy`,
  `actor/ppo_kl`, `actor/pg_clipfrac`, `actor/grad_norm`, `critic/vf_loss`,
  `critic/score/mean`, `critic/rewards/mean`, `critic/advantages/mean`,
  `response_length/mean`, `timing_s/gen`, `timing_s/update_actor`, `val-core/...`), so
  a verl dashboard reads a fleetrl run; `trainer.logger` picks wandb, MLflow and
  TensorBoard (console is always on).

## Refused values

| verl key | fleetrl honours | otherwise set |
| --- | --- | --- |
"""


def _cell(value: Any) -> str:
    if value is NO_DEFAULT:
        return ""
    text = repr(value) if not isinstance(value, str) else value
    return f"`{text}`".replace("|", "\\|") if text != "" else "`''`"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _accepted(key: Key) -> str:
    if key.accept is None:
        return ""
    if key.accept is empty:
        return "`null` or empty"
    if callable(key.accept):
        return "see the fix"
    return ", ".join(_cell(v) for v in key.accept)


def _does(key: Key) -> str:
    if key.kind == "map":
        return f"`{key.to}`"
    if key.kind == "rule":
        return "rule: " + ", ".join(f"`{t.strip()}`" for t in key.to.split(","))
    return "no effect"


def render_verl_docs() -> str:
    lines = [GUIDE.rstrip("\n")]
    for key in TABLE.keys:
        if key.accept is not None:
            lines.append(f"| `{key.path}` | {_accepted(key)} | {_escape(key.fix)} |")
    lines += [
        "",
        "## Every verl key",
        "",
        "verl's `ppo_trainer.yaml` keys (its `_generated_ppo_trainer.yaml`, checked by",
        "tests/unit/launcher/test_verl_table.py) and a few of older releases (marked). A",
        "`**` row covers every key below it that has no row of its own; `*` is one segment.",
    ]
    for section in ["*", *TABLE.sections()]:
        title = "in every section" if section == "*" else f"`{section}`"
        lines += [
            "",
            f"### {title}",
            "",
            "| verl key | verl default | fleetrl | what it does here |",
            "| --- | --- | --- | --- |",
        ]
        for key in TABLE.keys:
            top = key.path.split(".")[0]
            if (top if section != "*" else top[0]) != section:
                continue
            why = key.why + (" (an older verl release's key)" if key.legacy else "")
            why += (
                " (in verl's config classes, not its default file: set with +key=)"
                if key.plus
                else ""
            )
            lines.append(f"| `{key.path}` | {_cell(key.default)} | {_does(key)} | {_escape(why)} |")
    return "\n".join(lines) + "\n"
