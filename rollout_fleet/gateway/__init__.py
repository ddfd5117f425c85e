"""The agent gateway: an OpenAI-compatible API in front of the fleet, token-in/token-out.

An agent program (its own loop, the OpenAI Agents SDK, LangChain, a process in
a container) is handed a ``base_url`` and an API key per episode and talks to the
policy as to OpenAI. Every call is rendered with the policy's chat template and
generated from token ids on the fleet's engines, and the episode keeps the ids,
logprobs and per-token versions the engines produced, so what the learner trains
on is exactly what the engines saw.

``server`` (routes, auth, restart), ``requests`` (bodies, what is refused),
``messages`` (a request's messages, checked), ``episodes`` (per-episode keys and
the token tree), ``rendering`` (prompt and template deltas), ``calls`` (one call
on the ``SampleRunner``), ``tool_parsers`` (tool calls in the template's format),
``replies`` (OpenAI's reply and SSE shapes), ``errors`` (OpenAI's error shape).
The episodes themselves are run by ``rollout_fleet.agents``.
"""
