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

Modules: ``launcher`` (start / stop, the test's read-out of each rank's
weights), ``http_process``, ``backend``, ``rank``, ``scheduler`` (state and the
token loop), ``model`` (the HF model behind SGLang's ``load_weights``),
``messages`` (every message between the processes).
"""

from .launcher import SGLangEngine, start_sglang_engine

__all__ = ["SGLangEngine", "start_sglang_engine"]
