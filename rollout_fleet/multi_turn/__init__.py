"""Multi-turn rollouts: a sample is a conversation between the policy and an environment.

``environment`` (the contract and how config names one), ``calculator`` (the
built-in tool), ``env_runner`` (steps off the loop with a timeout),
``chat_turns`` (an observation's tokens as the chat template renders them) and
``driver`` (the turn loop, on ``SampleRunner``). On with ``rollout.multi_turn.env``.
"""
