"""The GPU check (``scripts/gpu_check.py``): what one GPU proves in minutes that the CPU tiers
cannot, built for a GPU machine without a package registry (one H200, Python 3.12, torch 2.11;
see docs/gpu_check.md).

``check`` drives the stages of ``plan`` within one time budget, each in a process of its
own (``stage``), and writes ``report``'s JSON. The stages, one module each: ``machine``
(versions and measured ceilings), ``learner`` (bf16 tokens/s and MFU on a ~0.5 B model,
packed vs padded, peak memory vs the plan), ``rollout`` (the embedded engine vs
transformers ``generate``), ``weight_sync`` (+ ``ipc``: two processes on one device),
``demo`` (fleetrl train through Ray), ``accuracy`` (time to target, η 0 vs 4) and
``sglang_stages`` (a real SGLang server, where one can run). ``import_guard`` makes a
CPU run refuse what the GPU machine lacks.
"""
