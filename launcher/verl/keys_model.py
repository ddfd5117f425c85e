"""verl's ``actor_rollout_ref`` keys (model, actor, reference, rollout) and what fleetrl does
with each (``launcher.verl.table`` says how to read an entry)."""

from __future__ import annotations

import os
from typing import Any

from launcher.verl.table import MANDATORY, Key, M, N, R, empty, only

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
NOT_SUPPORTED = "fleetrl does not implement it"


def expand(path: Any) -> Any:
    return os.path.expanduser(path) if isinstance(path, str) else path


def modules(value: Any) -> list[str]:
    """verl's ``target_modules``: one name (``all-linear``) or a list."""
    return [value] if isinstance(value, str) else list(value)


ARR = "actor_rollout_ref"
A, RF, RO, MO = f"{ARR}.actor", f"{ARR}.ref", f"{ARR}.rollout", f"{ARR}.model"
OPTIM_WHY = "verl's AdamW (torch.optim); fleetrl's optimizer is AdamW"


def optim_keys(prefix: str, lr: float, to: str) -> list[Key]:
    """An FSDP optimizer section (the actor's and the critic's are alike)."""
    o = f"{prefix}.optim"
    # fmt: off
    return [
        N(f"{o}.optimizer", "AdamW", OPTIM_WHY, accept=only("AdamW"), fix="AdamW"),
        N(f"{o}.optimizer_impl", "torch.optim", OPTIM_WHY, accept=only("torch.optim"), fix="torch.optim"),
        M(f"{o}.lr", lr, f"{to}.lr"),
        R(f"{o}.lr_warmup_steps_ratio", 0.0, f"{to}.warmup_ratio", "used when lr_warmup_steps is -1 or null, as in verl"),
        N(f"{o}.total_training_steps", -1, "verl fills it from the trainer's step count; so does fleetrl (trainer.total_steps)", accept=only(-1, None), fix="-1, or set trainer.total_training_steps"),
        M(f"{o}.weight_decay", 0.01, f"{to}.weight_decay"),
        R(f"{o}.lr_warmup_steps", -1, f"{to}.warmup_steps", "> 0 wins over the ratio, as in verl"),
        M(f"{o}.betas", [0.9, 0.999], f"{to}.betas", convert=tuple),
        R(f"{o}.clip_grad", 1.0, f"{to}.grad_clip", "unless the deprecated grad_clip is set, which verl's FSDP workers read first"),
        M(f"{o}.min_lr_ratio", 0.0, f"{to}.min_lr_ratio", "cosine floor"),
        N(f"{o}.num_cycles", 0.5, "fleetrl's cosine decays once, over half a cycle", accept=only(0.5), fix="0.5"),
        R(f"{o}.lr_scheduler_type", "constant", f"{to}.schedule", "constant or cosine", accept=only("constant", "cosine"), fix="constant or cosine"),
        R(f"{o}.warmup_style", None, f"{to}.schedule", "deprecated alias of lr_scheduler_type (wins when set, as in verl)", accept=only(None, "constant", "cosine"), fix="constant or cosine"),
        N(f"{o}.override_optimizer_config", None, "extra optimizer arguments", accept=empty, fix="null"),
    ]
    # fmt: on


FSDP_WHY = "FSDP2 details fleetrl decides itself: each transformer block is one FSDP unit"


def fsdp_keys(prefix: str, learner: bool) -> list[Key]:
    """An ``fsdp_config`` section; the actor's offload keys are the learner's."""
    f = f"{prefix}.fsdp_config"
    # fmt: off
    keys = [
        N(f"{f}.**", why=FSDP_WHY),
        N(
            f"{f}.fsdp_size",
            -1,
            "fleetrl shards over every learner rank",
            accept=only(-1),
            fix="-1 (HSDP is not supported)",
        ),
        N(
            f"{f}.strategy",
            "fsdp",
            "fleetrl trains with FSDP2",
            accept=only("fsdp", "fsdp2"),
            fix="fsdp2",
        ),
    ]
    # fmt: on
    if learner:
        # fmt: off
        keys += [
            M(f"{f}.param_offload", False, "learner.param_offload", "policy and critic"),
            M(f"{f}.optimizer_offload", False, "learner.optimizer_offload"),
            M(f"{f}.reshard_after_forward", True, "learner.reshard_after_forward"),
            R(f"{f}.dtype", "bfloat16", "learner.mixed_precision", "bfloat16: bf16 compute with fp32 gradient reduction (fleetrl's auto on GPU); float32: fp32", accept=only("bfloat16", "bf16", "float32", "fp32"), fix="bfloat16 or float32"),
        ]
        # fmt: on
    return keys


PROFILER_WHY = "verl's per-role profiler; fleetrl profiles the steps global_profiler.steps lists (torch.profiler)"
# fmt: off
KEYS: list[Key] = [
    # ---- model
    M(f"{MO}.path", "~/models/deepseek-llm-7b-chat", "model.path", "~ expanded", convert=expand),
    N(f"{MO}.hf_config_path", None, "fleetrl reads config.json from model.path", accept=empty, fix="null (put the config in the model folder)"),
    N(f"{MO}.tokenizer_path", None, "fleetrl reads the tokenizer from model.path", accept=empty, fix="null (put the tokenizer in the model folder)"),
    N(f"{MO}.use_shm", False, "loading through /dev/shm"),
    N(f"{MO}.trust_remote_code", False, "fleetrl loads the architectures transformers knows; no remote code runs"),
    N(f"{MO}.custom_chat_template", None, "the chat template is the tokenizer's", accept=empty, fix="null (save the template with the tokenizer)"),
    N(f"{MO}.external_lib", None, "no module is imported to register a model", accept=empty, fix="null"),
    N(f"{MO}.override_config", {}, "the model's config.json is used as it is", accept=empty, fix="{} (edit config.json)"),
    M(f"{MO}.enable_gradient_checkpointing", True, "learner.grad_checkpointing", "verl's default is on; fleetrl's off"),
    N(f"{MO}.enable_activation_offload", False, "activation offload is not implemented"),
    M(f"{MO}.use_remove_padding", True, "learner.packing", "verl's remove-padding is fleetrl's packing (sequences packed without padding)"),
    M(f"{MO}.lora_rank", 0, "learner.lora.rank"),
    M(f"{MO}.lora_alpha", 16, "learner.lora.alpha"),
    M(f"{MO}.target_modules", "all-linear", "learner.lora.target_modules", convert=modules),
    N(f"{MO}.exclude_modules", None, "LoRA on every targeted module", accept=empty, fix="null (list the modules in target_modules)"),
    N(f"{MO}.lora_adapter_path", None, "LoRA adapters start fresh", accept=empty, fix="null"),
    N(f"{MO}.use_liger", False, "Liger kernels"),
    N(f"{MO}.use_fused_kernels", False, "verl's fused kernels"),
    N(f"{MO}.fused_kernel_options.impl_backend", "torch", "verl's fused kernels"),
    N(f"{MO}.tiled_mlp.**", why="tiled MLP is not implemented"),
    N(f"{MO}.tiled_mlp.enabled", False, "tiled MLP is not implemented"),
    N(f"{MO}.mtp.**", why="multi-token prediction is not supported"),
    N(f"{MO}.mtp.enable", False, "multi-token prediction is not supported", accept=only(False), fix="false"),
    R(f"{ARR}.hybrid_engine", True, "learner.num_ranks, rollout.num_engines", "verl's hybrid engine shares every GPU between training and rollout; fleetrl gives each its own GPUs (the split of trainer.n_gpus_per_node x nnodes)"),
    M(f"{ARR}.nccl_timeout", 600, "learner.distributed_timeout_s", "seconds"),
    # ---- actor
    *optim_keys(A, 1e-6, "learner.optim"),
    *fsdp_keys(A, learner=True),
    N(f"{A}.rollout_n", "${oc.select:actor_rollout_ref.rollout.n,1}", "verl's copy of rollout.n"),
    N(f"{A}.strategy", "fsdp", "fleetrl trains with FSDP2", accept=only("fsdp", "fsdp2"), fix="fsdp2 (Megatron is not supported)"),
    M(f"{A}.ppo_mini_batch_size", 256, "learner.ppo_mini_batch_size", "prompts per optimizer step, in both"),
    R(f"{A}.ppo_micro_batch_size", None, "learner.micro_batch_size", "deprecated global size: divided by the learner ranks (used without use_dynamic_bsz)"),
    R(f"{A}.ppo_micro_batch_size_per_gpu", None, "learner.micro_batch_size", "sequences per micro-batch and rank without use_dynamic_bsz"),
    M(f"{A}.use_dynamic_bsz", False, "learner.use_dynamic_bsz", "verl's default is off; fleetrl's on"),
    M(f"{A}.ppo_max_token_len_per_gpu", 16384, "learner.max_tokens_per_micro_batch", "the critic uses the same budget"),
    R(f"{A}.clip_ratio", 0.2, "learner.policy_loss.clip_ratio_low, learner.policy_loss.clip_ratio_high", "the bound where clip_ratio_low/high are null, as in verl"),
    R(f"{A}.clip_ratio_low", 0.2, "learner.policy_loss.clip_ratio_low", "null = clip_ratio"),
    R(f"{A}.clip_ratio_high", 0.2, "learner.policy_loss.clip_ratio_high", "null = clip_ratio"),
    N(f"{A}.tau_pos", 1.0, "SAPO's smoothing (loss_mode sapo is not implemented)"),
    N(f"{A}.tau_neg", 1.05, "SAPO's smoothing (loss_mode sapo is not implemented)"),
    N(f"{A}.freeze_vision_tower", False, "multimodal models are not supported"),
    M(f"{A}.policy_loss.loss_mode", "vanilla", "learner.policy_loss.loss_mode", accept=only("vanilla", "gspo"), fix=f"vanilla or gspo (other verl losses: {NOT_SUPPORTED})"),
    N(f"{A}.policy_loss.clip_cov_ratio", 0.0002, "Clip-Cov (not implemented)"),
    N(f"{A}.policy_loss.clip_cov_lb", 1.0, "Clip-Cov (not implemented)"),
    N(f"{A}.policy_loss.clip_cov_ub", 5.0, "Clip-Cov (not implemented)"),
    N(f"{A}.policy_loss.kl_cov_ratio", 0.0002, "KL-Cov (not implemented)"),
    N(f"{A}.policy_loss.ppo_kl_coef", 0.1, "KL-Cov (not implemented)"),
    M(f"{A}.clip_ratio_c", 3.0, "learner.policy_loss.clip_ratio_c", "dual clip"),
    M(f"{A}.loss_agg_mode", "token-mean", "learner.policy_loss.loss_agg_mode", "seq-mean-token-sum-norm is Dr. GRPO's sequence mean (docs/verl.md: what differs)", accept=only("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"), fix="token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm"),
    M(f"{A}.loss_scale_factor", None, "learner.policy_loss.loss_scale_factor", "null = the maximum response length", convert=lambda v: v or 0),
    M(f"{A}.entropy_coeff", 0, "learner.policy_loss.entropy_coeff"),
    N(f"{A}.calculate_entropy", False, "fleetrl always reports actor/entropy"),
    M(f"{A}.use_kl_loss", False, "learner.kl.use_kl_loss"),
    N(f"{A}.use_prefix_grouper", False, "the prefix grouper is not implemented (packing shares no prefix)"),
    N(f"{A}.use_torch_compile", True, "torch.compile is not used"),
    M(f"{A}.kl_loss_coef", 0.001, "learner.kl.kl_loss_coef"),
    M(f"{A}.kl_loss_type", "low_var_kl", "learner.kl.kl_kind", accept=only(*KL_KINDS), fix=", ".join(KL_KINDS)),
    M(f"{A}.ppo_epochs", 1, "learner.ppo_epochs"),
    N(f"{A}.shuffle", False, "fleetrl's mini-batches are whole groups in hand-out order"),
    N(f"{A}.data_loader_seed", 42, "fleetrl's mini-batches are whole groups in hand-out order"),
    N(f"{A}.checkpoint.**", why="a fleetrl checkpoint holds model, optimizer and everything to resume"),
    N(f"{A}.checkpoint.save_contents", ["model", "optimizer", "extra"], "a fleetrl checkpoint holds everything; `fleetrl export` writes the Hugging Face model"),
    N(f"{A}.checkpoint.load_contents", "${.save_contents}", "a fleetrl checkpoint holds everything"),
    N(f"{A}.checkpoint.async_save", False, "checkpoints are written synchronously"),
    N(f"{A}.use_fused_kernels", "${oc.select:actor_rollout_ref.model.use_fused_kernels,false}", "verl's fused kernels"),
    N(f"{A}.profiler.**", why=PROFILER_WHY),
    N(f"{A}.router_replay.**", why="MoE routing replay is not implemented"),
    N(f"{A}.router_replay.mode", "disabled", "MoE routing replay is not implemented", accept=only("disabled"), fix="disabled"),
    R(f"{A}.grad_clip", 1.0, "learner.optim.grad_clip", "verl's FSDP actor clips with this one (optim.clip_grad is read when it is left at 1.0)"),
    M(f"{A}.ulysses_sequence_parallel_size", 1, "learner.sequence_parallel", "Ulysses"),
    N(f"{A}.entropy_from_logits_with_chunking", False, "memory detail of verl's entropy"),
    N(f"{A}.entropy_checkpointing", False, "memory detail of verl's entropy"),
    N(f"{A}.use_remove_padding", "${oc.select:actor_rollout_ref.model.use_remove_padding,false}", "follows actor_rollout_ref.model.use_remove_padding (learner.packing)"),
    N(f"{A}.calculate_sum_pi_squared", False, "a diagnostic metric"),
    N(f"{A}.sum_pi_squared_checkpointing", False, "a diagnostic metric"),
    # ---- reference
    N(f"{RF}.**", why="the reference's forward runs on the learner ranks with their micro-batches"),
    N(f"{RF}.profiler.**", why=PROFILER_WHY),
    M(f"{RF}.fsdp_config.param_offload", False, "learner.reference.param_offload"),
    N(f"{RF}.strategy", "${actor_rollout_ref.actor.strategy}", "fleetrl trains with FSDP2", accept=only("fsdp", "fsdp2"), fix="fsdp2"),
    # ---- rollout
    R(f"{RO}.name", MANDATORY, "rollout.backend", "sglang: SGLang servers; vllm: vLLM servers (`vllm serve` with its weight-transfer routes); fleetrl.rollout.backend=embedded runs the CPU engine instead", accept=only("sglang", "vllm"), fix="sglang or vllm (HF and TensorRT-LLM rollouts are not supported)"),
    N(f"{RO}.mode", "async", "fleetrl's engines always serve asynchronously over HTTP"),
    M(f"{RO}.temperature", 1.0, "rollout.temperature", "the learner recomputes logprobs at it"),
    M(f"{RO}.top_k", -1, "rollout.top_k"),
    M(f"{RO}.top_p", 1, "rollout.top_p", convert=float),
    N(f"{RO}.prompt_length", "${oc.select:data.max_prompt_length,512}", "prompts are cut by data.max_prompt_length; the engine's context is the model's"),
    M(f"{RO}.response_length", "${oc.select:data.max_response_length,512}", "rollout.max_new_tokens", "the response budget (default: data.max_response_length)"),
    M(f"{RO}.dtype", "bfloat16", "model.dtype", accept=only("bfloat16", "float16", "float32"), fix="bfloat16, float16 or float32"),
    R(f"{RO}.gpu_memory_utilization", 0.5, "rollout.mem_fraction_static, rollout.gpu_memory_utilization", "SGLang's --mem-fraction-static (name: sglang) or vLLM's --gpu-memory-utilization (name: vllm): their own GPUs here, so raise it"),
    N(f"{RO}.ignore_eos", False, "responses end at EOS", accept=only(False), fix="false"),
    N(f"{RO}.enforce_eager", False, "the engine's CUDA graphs: pass --disable-cuda-graph in fleetrl.rollout.sglang_extra_args (SGLang) or --enforce-eager in fleetrl.rollout.vllm_extra_args (vLLM)"),
    N(f"{RO}.cudagraph_capture_sizes", None, "the engine's CUDA graphs: --cuda-graph-bs in fleetrl.rollout.sglang_extra_args (SGLang) or --cudagraph-capture-sizes in fleetrl.rollout.vllm_extra_args (vLLM)"),
    N(f"{RO}.free_cache_engine", True, "verl's hybrid engine frees the rollout's KV cache (and weights) for each training phase; the engines here keep GPUs of their own between steps (co-located ones, fleetrl.rollout.placement: colocated, release theirs at every step, as fleetrl.rollout.colocate.release says)"),
    N(f"{RO}.enable_sleep_mode", True, "vLLM's sleep mode (--enable-sleep-mode) is how verl's hybrid engine frees a vLLM engine's memory for training; the vLLM engines here keep GPUs of their own and never sleep (co-location is SGLang's)", plus=True),
    R(f"{RO}.tensor_model_parallel_size", 2, "rollout.gpus_per_engine", "the engine's tensor parallel size (SGLang's --tp-size, vLLM's --tensor-parallel-size): the GPUs of one engine"),
    N(f"{RO}.data_parallel_size", 1, "fleetrl scales engines by number (the GPU split)", accept=only(1), fix="1 (set fleetrl.rollout.num_engines)"),
    R(f"{RO}.expert_parallel_size", 1, "rollout.sglang_extra_args", "> 1: SGLang's --ep-size"),
    N(f"{RO}.pipeline_model_parallel_size", 1, "pipeline parallel engines are not supported", accept=only(1), fix="1"),
    N(f"{RO}.max_num_batched_tokens", 8192, "vLLM's prefill budget (SGLang: --chunked-prefill-size in fleetrl.rollout.sglang_extra_args)"),
    R(f"{RO}.max_model_len", None, "rollout.sglang_extra_args", "set: SGLang's --context-length"),
    M(f"{RO}.max_num_seqs", 256, "rollout.max_running_requests", "sequences an engine decodes at once"),
    N(f"{RO}.enable_chunked_prefill", True, "SGLang chunks prefills by default"),
    R(f"{RO}.enable_prefix_caching", True, "rollout.sglang_extra_args", "false: SGLang's --disable-radix-cache"),
    N(f"{RO}.logprobs_mode", "processed_logprobs", "the engines report logprobs of the distribution sampled from (temperature applied)", accept=only("processed_logprobs"), fix="processed_logprobs"),
    N(f"{RO}.scheduling_policy", "fcfs", "SGLang's --schedule-policy (fleetrl.rollout.sglang_extra_args)"),
    M(f"{RO}.load_format", "dummy", "rollout.sglang_load_format", "dummy: the first weights come from the learner", accept=only("dummy", "auto"), fix="dummy or auto"),
    N(f"{RO}.log_prob_micro_batch_size", None, "the learner recomputes logprobs with its own micro-batches"),
    N(f"{RO}.log_prob_micro_batch_size_per_gpu", None, "the learner recomputes logprobs with its own micro-batches"),
    N(f"{RO}.log_prob_use_dynamic_bsz", "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}", "the learner recomputes logprobs with its own micro-batches"),
    N(f"{RO}.log_prob_max_token_len_per_gpu", "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}", "the learner recomputes logprobs with its own micro-batches"),
    N(f"{RO}.disable_log_stats", True, "engine statistics go to the engines' logs"),
    N(f"{RO}.do_sample", True, "training samples (greedy decoding gives a group no spread)", accept=only(True), fix="true"),
    M(f"{RO}.n", 1, "rollout.n", "verl's default is 1; fleetrl's 4"),
    N(f"{RO}.over_sample_rate", 0, "fleetrl's rollouts are asynchronous: no step waits for the slowest sample", accept=only(0, 0.0), fix="0"),
    N(f"{RO}.multi_stage_wake_up", False, "the engines keep their GPUs (no co-location)"),
    N(f"{RO}.engine_kwargs.vllm", {}, "vLLM is not used"),
    M(f"{RO}.engine_kwargs.sglang", {}, "rollout.sglang_extra_args", "each entry becomes --name value (underscores as dashes)", convert=lambda kw: [a for k, v in (kw or {}).items() for a in (f"--{k.replace('_', '-')}", str(v))]),
    N(f"{RO}.engine_kwargs.trtllm", {}, "TensorRT-LLM is not used"),
    N(f"{RO}.val_kwargs.top_k", -1, "validation samples with rollout.top_k"),
    N(f"{RO}.val_kwargs.top_p", 1.0, "validation samples with rollout.top_p"),
    R(f"{RO}.val_kwargs.temperature", 0, "rollout.val_temperature", "0 when do_sample is false (greedy), as in verl"),
    N(f"{RO}.val_kwargs.n", 1, "validation scores one sample per prompt", accept=only(1), fix="1"),
    R(f"{RO}.val_kwargs.do_sample", False, "rollout.val_temperature", "false: greedy"),
    N(f"{RO}.multi_turn.**", why="verl's tool and interaction configs are not read; fleetrl's multi-turn runs a Python environment (fleetrl.rollout.multi_turn.env)"),
    N(f"{RO}.multi_turn.enable", False, "verl's multi-turn tools are not read", accept=only(False), fix="false (use fleetrl.rollout.multi_turn.env, a Python environment)"),
    N(f"{RO}.calculate_log_probs", False, "the engines always return behaviour logprobs"),
    N(f"{RO}.agent.**", why="verl's agent loop workers; fleetrl's rollout workers are asyncio tasks"),
    N(f"{RO}.agent.default_agent_loop", "single_turn_agent", "one completion per sample", accept=only("single_turn_agent"), fix="single_turn_agent (multi-turn: fleetrl.rollout.multi_turn.env)"),
    N(f"{RO}.agent.agent_loop_config_path", None, "verl agent loops are not loaded", accept=empty, fix="null"),
    N(f"{RO}.agent.custom_async_server.path", None, "no custom server class", accept=empty, fix="null"),
    N(f"{RO}.checkpoint_engine.**", why="weights go by fleetrl's weight sync (NCCL broadcast, SGLang's protocol)"),
    M(f"{RO}.checkpoint_engine.update_weights_bucket_megabytes", 2048, "weight_sync.bucket_mb", "bucket size of the weight broadcast"),
    N(f"{RO}.trace.**", why="rollout tracing is not implemented"),
    N(f"{RO}.skip_rollout", False, "rollouts are never replayed from a dump", accept=only(False), fix="false"),
    N(f"{RO}.skip_dump_dir", "/tmp/rollout_dump", "every rollout is kept in the rollout bank (<run dir>/rollout_bank)"),
    N(f"{RO}.skip_tokenizer_init", True, "the engines receive token ids"),
    N(f"{RO}.enable_rollout_routing_replay", False, "MoE routing replay is not implemented", accept=only(False), fix="false"),
    N(f"{RO}.profiler.**", why=PROFILER_WHY),
    N(f"{RO}.prometheus.**", why="engine metrics: SGLang's --enable-metrics in fleetrl.rollout.sglang_extra_args"),
    N(f"{RO}.quantization", None, "quantized rollouts are not supported (the weight sync sends full weights)", accept=empty, fix="null"),
    N(f"{RO}.quantization_config_file", None, "quantized rollouts are not supported", accept=empty, fix="null"),
    N(f"{RO}.mtp", "${oc.select:actor_rollout_ref.model.mtp, null}", "multi-token prediction is not supported"),
    N(f"{RO}.layered_summon", False, "the weight sync streams parameters one by one"),
]
# fmt: on
