"""Model runner: a Hugging Face causal LM, its batched KV cache, and its weights.

Owns the model and is driven by exactly one thread (the scheduler), so nothing
here locks. Two forward kinds:

- ``prefill(prompts)``: prompts of equal length run as one unpadded batch
  (no padding, so no fully-masked query rows); returns last-position logits and
  the per-layer KV to splice into the running batch.
- ``decode(next_tokens)``: one token for every running row, against the
  right-aligned batch cache (``kv_cache.BatchKVCache``); returns ``[rows, V]`` logits.
  Llama-family models (Qwen2/3, Llama, Mistral) take the fused step of
  ``fused_decoder`` (same maths, a fraction of the per-step overhead); other
  architectures, or ``fused_decode=False``, run the Hugging Face forward.

Weights: ``load_weights(named_tensors)`` copies received tensors into the
parameters by Hugging Face name, module or checkpoint (validated first: unknown names or shape
mismatches fail before anything is copied); ``weight_rows(name, rows)``
answers ``/get_weights_by_name`` for verification, in SGLang's reply shape.

LoRA: ``apply_adapter(weights)`` merges one adapter into the weights of the
modules it targets (``W = W_base + scale * B @ A``, written in place so the fused
decoder's views see it), keeping the base copy of each targeted weight so the
next adapter replaces the last one instead of adding to it; ``remove_adapter``
restores the base. One adapter at a time serves every request (the engine's
server aborts requests that named another one; see ``EmbeddedEngine``).

Left out: tensor parallelism, CUDA graphs, quantisation.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from fleetrl.log import get_logger
from fleetrl.models.checkpoint_names import CheckpointNames
from fleetrl.models.loading import load_causal_lm, load_tokenizer
from rollout_fleet.engine.fused_decoder import FusedDecoder, build_fused_decoder
from rollout_fleet.engine.kv_cache import BatchKVCache
from weight_sync.adapters import LoraWeights

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(ValueError):
    """Received tensors do not match the model (unknown name, shape or dtype), or its
    weight memory is released (``memory_saver``)."""


def is_resident(tensor: torch.Tensor) -> bool:
    """Whether a tensor's storage holds its bytes (not released by the memory saver)."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.numel() == 0 or tensor.untyped_storage().nbytes() >= needed


@torch.inference_mode()
def copy_weights(
    targets: dict[str, torch.Tensor],
    named_tensors: list[tuple[str, torch.Tensor]],
    model_path: str,
    device: torch.device,
) -> None:
    """Copy ``named_tensors`` into ``targets`` (a model's state dict) by name, after checking
    every name, shape and dtype, and that no target's memory is released, first: a bad
    update raises ``WeightLoadError`` and changes nothing."""
    for name, tensor in named_tensors:
        if name not in targets:
            near = [n for n in targets if n.endswith(name.split(".")[-1])][:3]
            raise WeightLoadError(
                f"received weight {name!r} is not a parameter of {model_path}"
                f" (similar names: {near})"
            )
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise WeightLoadError(
                f"received weight {name!r} has shape {tuple(tensor.shape)},"
                f" the model's is {tuple(targets[name].shape)}"
            )
        if not (tensor.is_floating_point() or tensor.dtype == targets[name].dtype):
            raise WeightLoadError(f"received weight {name!r} has dtype {tensor.dtype}")
        if not is_resident(targets[name]):
            raise WeightLoadError(
                f"the memory of weight {name!r} is released: resume the engine's weights "
                "(/resume_memory_occupation) before loading"
            )
    for name, tensor in named_tensors:
        targets[name].data.copy_(tensor.to(device=device), non_blocking=False)


class ModelRunner:
    """Forward passes and weight updates for one model on one device."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        fused_decode: bool = True,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; accepted: {sorted(_DTYPES)}")
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        config = self.model.config.get_text_config(decoder=True)
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = self._eos_ids()
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.x names the cache argument ``cache``; older ones ``past_key_values``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.kv = BatchKVCache(int(config.num_hidden_layers), self.device, self.dtype)
        self.fused: FusedDecoder | None = build_fused_decoder(self.model) if fused_decode else None
        self.checkpoint_names = CheckpointNames.of(self.model)
        self._base_weights: dict[str, torch.Tensor] = {}  # LoRA: base copies of targeted weights
        log.info(
            "loaded %s on %s (%s): vocab %d, max context %d, eos %s, fused decode %s",
            self.model_path,
            self.device,
            dtype,
            self.vocab_size,
            self.max_context,
            sorted(self.eos_token_ids),
            "on" if self.fused is not None else "off",
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- forward passes -------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, prompts: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run ``prompts [k, P]`` (equal lengths, no padding) from an empty cache.

        Returns ``(last logits [k, V], keys per layer, values per layer)``.
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(
            input_ids=prompts.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return out.logits[:, -1, :], keys, values

    @torch.inference_mode()
    def decode(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for every running row; ``next_tokens [rows]``. Returns ``[rows, V]``."""
        kv = self.kv
        kv.ensure_room(1)
        attend = kv.step_mask()
        if self.fused is not None:
            logits = self.fused.decode(
                next_tokens, kv.positions, kv.keys, kv.values, attend, kv.length
            )
        else:
            out = self.model(
                input_ids=next_tokens[:, None],
                attention_mask=attend.long(),
                position_ids=kv.positions[:, None],
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: kv.hf_cache()},
            )
            logits = out.logits[:, -1, :]
        kv.advance()
        return logits

    @torch.inference_mode()
    def full_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """``log_softmax(logits / T)`` at every position of one sequence (for verification)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids).logits[0].float()
        return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)

    # -- weights ---------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors by module name, and by the name its files give them where that
        differs (GPT-NeoX's ``embed_out.weight`` is ``lm_head.weight``): a learner and a
        folder on disk send the files' names."""
        named = dict(self.model.state_dict(keep_vars=True))
        for name in list(named):
            named.setdefault(self.checkpoint_names.to_file(name), named[name])
        return named

    @torch.inference_mode()
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy ``named_tensors`` into the model by Hugging Face name; returns the count.

        Everything is validated before the first copy, so a bad update leaves the
        model unchanged.
        """
        copy_weights(self.named_weights(), named_tensors, self.model_path, self.device)
        if self._base_weights:
            log.warning("full weights loaded over a merged LoRA adapter: they are the new base")
            self._base_weights.clear()
        if self.fused is not None:
            self.fused.check_fused()
        return len(named_tensors)

    @torch.inference_mode()
    def apply_adapter(self, weights: LoraWeights) -> int:
        """Serve ``base + adapter`` (replacing any adapter merged before); returns the
        number of weights it changes. Validated first: a module the model lacks or a
        shape mismatch leaves the weights unchanged."""
        targets = self.named_weights()
        deltas: dict[str, torch.Tensor] = {}
        for module in weights.a:
            name = f"{module}.weight"
            if name not in targets:
                raise WeightLoadError(
                    f"adapter module {module!r} has no weight {name!r} in {self.model_path}"
                )
            delta = weights.delta(module)
            if tuple(delta.shape) != tuple(targets[name].shape):
                raise WeightLoadError(
                    f"adapter update of {name!r} has shape {tuple(delta.shape)},"
                    f" the model's is {tuple(targets[name].shape)}"
                )
            deltas[name] = delta
        self._restore_base(targets)
        for name, delta in deltas.items():
            param = targets[name]
            base = param.detach().clone()
            self._base_weights[name] = base
            merged = base.float() + delta.to(device=self.device)
            param.data.copy_(merged.to(param.dtype))
        if self.fused is not None:
            self.fused.check_fused()
        return len(deltas)

    @torch.inference_mode()
    def remove_adapter(self) -> None:
        """Serve the base weights again."""
        self._restore_base(self.named_weights())
        if self.fused is not None:
            self.fused.check_fused()

    def _restore_base(self, targets: dict[str, torch.Tensor]) -> None:
        for name, base in self._base_weights.items():
            targets[name].data.copy_(base)
        self._base_weights.clear()

    def weight_rows(self, name: str, rows: int) -> list | None:
        """The leading ``rows`` rows of the tensor named ``name`` (HF name) as float lists,
        as SGLang's ``/get_weights_by_name`` returns them; None for an unknown name."""
        tensor = self.named_weights().get(name)  # tied and file names included
        if tensor is None or not is_resident(tensor):
            return None
        return tensor.detach()[:rows].to("cpu", torch.float32).tolist()
