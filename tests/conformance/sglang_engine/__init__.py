"""A real SGLang HTTP server on CPU in which only the engine internals are ours.

The conformance tier tests fleetrl against SGLang's own code (DESIGN §5, §7).
SGLang has no CPU engine, so this package runs SGLang's HTTP app, its
tokenizer-manager control code, and its scheduler- and model-runner-side
weight-update code in real processes, over a small Hugging Face model:

    test ──HTTP──> [HTTP process]  SGLang's FastAPI app + auth middleware
                        │           backend.py: SGLang's TokenizerManager methods
                        │           + our generate_request
                        │ pipes (io_struct messages, msgpack)
                 ┌──────┴──────┐
            [TP rank 0]   [TP rank 1]   rank.py: gloo TP group, SGLang's
             generates                  SchedulerWeightUpdaterManager,
                                        WeightUpdater, WeightExporter,
                                        SchedulerFlushWrapper
    trainer rank 0 ──gloo (init_custom_process_group)──> every TP rank

Where it differs from a real SGLang server (none of it is in the weight-sync
protocol): no KV or radix cache (each step recomputes the sequence, so after an
in-place pause the old prefix is not reused as stale KV), an aborted running
request finishes at once instead of after one more decode step, no input-token
or top-k logprobs, no stop strings, no OpenAI chat templates, TP ranks hold
full weight copies (TP rank 0 alone generates).

Modules: ``launcher`` (start / stop, the test's read-out of each rank's
weights), ``http_process``, ``backend``, ``rank``, ``scheduler`` (state and the
token loop), ``model`` (the HF model behind SGLang's ``load_weights``),
``messages`` (every message between the processes).
"""

from .launcher import SGLangEngine, start_sglang_engine

__all__ = ["SGLangEngine", "start_sglang_engine"]
