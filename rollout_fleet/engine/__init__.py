"""The embedded SGLang-compatible engine: a continuous-batching HTTP server over any
Hugging Face causal LM, for CPU runs and single-GPU nodes without SGLang.

Modules, in data-flow order: ``server`` (aiohttp app, ``EmbeddedEngine``; its
weight-update and LoRA routes in ``weight_routes`` and ``adapter_routes``, JSON
bodies and replies in ``http_json``; ``cli`` starts it) -> ``requests`` (body ->
sequences -> response objects) -> ``scheduler`` (the one thread that owns the
model: batching, pause modes, aborts, weight loads) -> ``runner`` (forward
passes, weights) -> ``kv_cache`` (the right-aligned batch cache) and
``sampling`` (batched per-row sampling and the reported logprob).
"""
