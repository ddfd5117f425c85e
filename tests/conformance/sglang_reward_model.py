"""A reward-model folder loaded the way an SGLang 0.5.23 server loads it, on CPU.

Run in a fresh process (SGLang's runtime context and model-parallel groups are
process-wide)::

    python -m tests.conformance.sglang_reward_model FOLDER OUT.json

What runs is SGLang's own code: ``ServerArgs`` and ``publish`` (the folder's config, as
a server resolves it), its model-parallel groups (gloo, one rank), ``get_model_loader``
and ``DefaultModelLoader.load_model`` (the model registry picks the class from the
folder's ``architectures``, the loader finds the weight files, the model's
``load_weights`` maps the names: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``,
``lm_head`` filtered). SGLang has no CPU engine, so the forward that serves ``/classify``
(RadixAttention over a ForwardBatch) does not run; instead the loaded model is read back
and compared tensor by tensor with the folder, and SGLang's loaded ``score`` head is
applied to the last-token hidden states transformers computes from the same weights
(equal backbone tensors, proven here, make those SGLang's hidden states too).

One choice is ours: SGLang picks its rotary kernel when the model is built, importing
vLLM's unless ``SGLANG_USE_CPU_ENGINE`` (which needs ``sgl_kernel``) marks a CPU engine;
we select its own torch-native path, which holds no weights.

The JSON written: ``class`` (SGLang's model class), ``params`` ({name: shape}),
``mismatched`` (SGLang parameters not equal to the folder's tensors), ``score_bias``
(the loaded bias, or null when the head has none), ``head_max_abs_diff`` (SGLang's head
on transformers' hidden states against transformers' scores), ``sglang_scores``,
``transformers_scores``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch

# SGLang's stacked parameters: (its name part, the checkpoint's parts in order)
STACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
SEQUENCES = [[6, 10, 11, 12, 5], [6, 20, 21, 22, 23, 24, 5], [6, 30, 5]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_with_sglang(folder: str):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=folder, device="cpu", tp_size=1, dtype="float32", is_embedding=True
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
    )  # fmt: skip
    parallel_state.initialize_model_parallel(backend="gloo")
    import sglang.srt.layers.rotary_embedding.base as rotary

    rotary._is_cpu = True  # its torch-native rotary path (see the module docstring)
    model_config = ModelConfig.from_server_args(server_args)
    loader = get_model_loader(LoadConfig(load_format="auto"), model_config)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def expected_tensor(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The folder's tensor that SGLang's parameter ``name`` must hold (stacked ones joined)."""
    for stacked, parts in STACKED:
        if stacked in name:
            pieces = [tensors.get(name.replace(stacked, part)) for part in parts]
            return None if any(p is None for p in pieces) else torch.cat(pieces, dim=0)
    return tensors.get(name)


def transformers_last_hidden(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-token hidden states [n, hidden], transformers' scores [n]) of ``SEQUENCES``."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    hidden, scores = [], []
    with torch.no_grad():
        for seq in SEQUENCES:
            ids = torch.tensor([seq])
            hidden.append(model.model(input_ids=ids).last_hidden_state[0, -1])
            scores.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(hidden), torch.stack(scores)


def main(folder: str, out: str) -> None:
    model = load_with_sglang(folder)
    tensors = folder_tensors(Path(folder))
    mismatched = []
    for name, param in model.named_parameters():
        want = expected_tensor(name, tensors)
        got = param.detach().float()
        if want is not None and got.shape != want.shape and name.endswith("embed_tokens.weight"):
            got = got[: want.shape[0]]  # VocabParallelEmbedding pads rows to a multiple of 64
        if want is None or got.shape != want.shape or not torch.equal(got, want.float()):
            mismatched.append(name)
    hidden, hf_scores = transformers_last_hidden(folder)
    with torch.no_grad():
        head = model.score if hasattr(model, "score") else model.classification_head
        sglang_scores = head(hidden.to(next(head.parameters()).dtype)).float()[:, 0]
    bias = getattr(head, "bias", None)
    result = {
        "class": type(model).__name__,
        "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "mismatched": mismatched,
        "score_bias": None if bias is None else bias.detach().float().tolist(),
        "head_max_abs_diff": float((sglang_scores - hf_scores).abs().max()),
        "sglang_scores": sglang_scores.tolist(),
        "transformers_scores": hf_scores.tolist(),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
