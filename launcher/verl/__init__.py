"""verl configs with verl's meaning: a verl ``ppo_trainer.yaml``-layout file runs on fleetrl.

``fleetrl train|check|plan|config show --config verl.yaml`` recognise verl's layout
(``data`` / ``actor_rollout_ref`` / ``critic`` / ``reward_model`` /
``custom_reward_function`` / ``algorithm`` / ``trainer`` / ``global_profiler`` ...) and
translate it into a fleetrl ``RunConfig``:

    verl file (+ dotted verl overrides)          launcher/verl/load.py
      -> merged over verl's defaults, interpolations resolved by OmegaConf (as verl does)
      -> every leaf looked up in the key table     launcher/verl/table.py (+ keys_*.py)
           mapped | noted (no effect here, named once) | refused (exit 2, what to set)
      -> the rules that span keys                  launcher/verl/translate.py
           (GPU split, steps, warm-up, clip ratios, corrections, logging backends)
      -> the file's ``fleetrl:`` section and fleetrl overrides, last
    ``fleetrl config from-verl IN --out OUT``      launcher/verl/from_verl.py
    docs/verl.md, generated from the table         launcher/verl/docs.py

Left out: verl's Hydra config groups beyond ``ppo_trainer`` (megatron, other
``defaults`` entries are refused), verl checkpoints (not loadable), vLLM rollouts.
"""
