"""The embedded SGLang-compatible engine: a continuous-batching HTTP server over any
Hugging Face causal LM, for CPU runs and single-GPU nodes without SGLang, and its
reward-model counterpart for ``*ForSequenceClassification`` folders.

Modules, in data-flow order: ``kinds`` (which engine serves a folder) and ``cli``
(``fleetrl engine``; options in ``cli_args``) -> ``http_service`` (what both servers
share: bind rule, bearer key, error middleware, serving threads) ->

- generation: ``server`` (aiohttp app, ``EmbeddedEngine``; its weight-update and LoRA
  routes in ``weight_routes`` and ``adapter_routes``, JSON bodies and replies in
  ``http_json``) -> ``requests`` (body -> sequences -> response objects) -> ``scheduler``
  (the one thread that owns the model: batching, pause modes, aborts, weight loads) ->
  ``runner`` (forward passes, weights) -> ``kv_cache`` (the right-aligned batch cache)
  and ``sampling`` (batched per-row sampling and the reported logprob);
- reward models: ``reward_server`` (``RewardEngine``: SGLang's ``/classify`` and
  ``/encode``) -> ``embedding_requests`` (body -> token lists -> SGLang's reply items) ->
  ``score_worker`` (the one thread that merges waiting requests into forwards) ->
  ``score_runner`` (sorted, padded forwards; the head at the last token).
"""
