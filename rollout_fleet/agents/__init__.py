"""Agent programs as the rollout: ``rollout.agent.entrypoint`` run once per episode.

``entrypoint`` (the contract and how config names an agent), ``config``
(``rollout.agent``), ``rollout`` (``AgentRollout``: the gateway, its watchdog, one
episode from key to trajectories). The worker's part, a group of ``rollout.n``
episodes scored and sent, is ``rollout_fleet.agents.groups``. The gateway the
agents call is ``rollout_fleet.gateway``.
"""
