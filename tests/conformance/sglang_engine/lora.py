"""The TP rank's LoRA adapters: a stand-in for SGLang's ``LoRAManager``, applied with peft.

SGLang's scheduler hands ``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput``
(with the ``lora_id`` its TokenizerManager assigned) to the model runner's
``LoRAManager``, which answers a ``LoRAUpdateOutput`` listing every loaded
adapter. Its GPU memory pool and kernels have no CPU path, so here:

- the adapter's config is read by SGLang's own ``LoRAConfig(path)``, and the
  checks of ``LoRAManager.validate_new_adapter`` that concern a PEFT folder run
  with SGLang's messages (a name already loaded; DoRA; a rank above
  ``--max-lora-rank``);
- the weights go into the rank's HF model with peft (``PeftModel.from_pretrained``
  for the first adapter, ``load_adapter`` after), one peft adapter per ``lora_id``,
  removed with ``delete_adapter``;
- a request runs with its own adapter (``set_adapter``) or, without one, on the
  base model (``disable_adapter``): per request, as SGLang serves them.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.managers import io_struct as io
from sglang.srt.runtime_context import get_lora

logger = logging.getLogger(__name__)


class LoraAdapters:
    """Adapters loaded on one TP rank's model, by SGLang's ``lora_id``."""

    def __init__(self, hf_model: torch.nn.Module):
        self.hf_model = hf_model
        self.peft_model = None
        self.refs: dict[str, io.LoadLoRAAdapterReqInput] = {}  # lora_id -> the load request

    def _result(self, success: bool, error: str = "") -> io.LoRAUpdateOutput:
        return io.LoRAUpdateOutput(
            success=success,
            error_message=error,
            loaded_adapters={r.lora_name: r.lora_path for r in self.refs.values()},
        )

    def load(self, req: io.LoadLoRAAdapterReqInput) -> io.LoRAUpdateOutput:
        try:
            config = LoRAConfig(req.lora_path)
            if config.use_dora:
                raise ValueError(
                    f"Failed to load {req.lora_name} because LoRA serving currently doesn't"
                    " support DoRA adapters"
                )
            if any(r.lora_name == req.lora_name for r in self.refs.values()):
                raise ValueError(
                    f"Failed to load LoRA adapter {req.lora_name} because it is already loaded"
                )
            if config.r > (get_lora().max_lora_rank or 0):
                raise ValueError(
                    f"LoRA adapter {req.lora_name} with rank {config.r} is incompatible with the"
                    " current LoRA memory pool configuration. Please ensure that the LoRA"
                    " adapter's rank is within the configured `--max-lora-rank` and that the"
                    " target modules are included in `--lora-target-modules`."
                )
            self._attach(req.lora_path, req.lora_id)
        except Exception as exc:  # SGLang's LoRAManager answers any failure this way
            return self._result(False, str(exc))
        self.refs[req.lora_id] = req
        return self._result(True)

    def _attach(self, path: str, lora_id: str) -> None:
        from peft import PeftModel

        if self.peft_model is None:
            self.peft_model = PeftModel.from_pretrained(self.hf_model, path, adapter_name=lora_id)
            self.peft_model.eval()
        else:
            self.peft_model.load_adapter(path, adapter_name=lora_id)

    def unload(self, req: io.UnloadLoRAAdapterReqInput) -> io.LoRAUpdateOutput:
        if req.lora_id in self.refs:
            self.peft_model.delete_adapter(req.lora_id)
            del self.refs[req.lora_id]
        return self._result(True)

    def forward(self, input_ids: torch.Tensor, lora_id: str | None) -> torch.Tensor:
        """Logits of ``input_ids`` with adapter ``lora_id`` (None: the base model)."""
        if self.peft_model is None:
            if lora_id is not None:
                raise ValueError(f"adapter {lora_id} is not loaded on this rank")
            return self.hf_model(input_ids=input_ids).logits
        if lora_id is None:
            ctx = self.peft_model.disable_adapter()
        else:
            if lora_id not in self.refs:
                raise ValueError(f"adapter {lora_id} is not loaded on this rank")
            self.peft_model.set_adapter(lora_id)
            ctx = contextlib.nullcontext()
        with ctx:
            return self.peft_model(input_ids=input_ids).logits
