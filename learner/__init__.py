"""Learner role: an FSDP2 group training the policy (and critic) with PPO/GRPO and
off-policy corrections for bounded staleness, a frozen reference for KL, checkpoints."""
