"""A reference engine for the weight-sync protocol: SGLang's weight endpoints over a dict of tensors.

It serves exactly the endpoints the learner's ``WeightSender`` calls, as
SGLang 0.5.23 defines them (``/init_weights_update_group``,
``/begin_weight_update``, ``/update_weights_from_distributed`` — refused
outside a begin..end session, as SGLang does — ``/end_weight_update``,
``/destroy_weights_update_group``, ``/pause_generation``,
``/continue_generation``, ``/flush_cache``, ``GET /model_info``,
``/update_weight_version``, ``/get_weights_by_name``, ``/health``, and for LoRA
``/load_lora_adapter`` / ``/unload_lora_adapter``: an adapter folder is read and
checked against the table, held by name, and applied to nothing) on top of a
``WeightReceiver`` and a plain name -> tensor table, and generates nothing. Tests and ``bench.weight_sync``
use it as the engine's stand-in; it is also the smallest worked example of what
an engine must do on its side. The real CPU engine is ``rollout_fleet.engine``.

Run one:  python -m weight_sync.reference_engine --model DIR --port 0 --port-file F
(``--model`` reads the folder's ``*.safetensors``; ``--spec`` reads a JSON list
of ``[name, dtype, shape]`` and starts from zeros).

Test hooks: ``POST /fleetrl/reference/save {path}`` writes the current tensors
to a safetensors file; ``--die-on-update N`` makes the process exit abruptly
when the N-th update request arrives (an engine dying mid-sync).

Left out: generation, and anything but a flat tensor table.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from fleetrl.log import get_logger, setup_logging
from weight_sync.buckets import parse_dtype
from weight_sync.receiver import WeightReceiver

log = get_logger(__name__)

DIE_EXIT_CODE = 17


class _NoRoute(Exception):
    """No handler for this method and path."""


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in a Hugging Face folder's ``*.safetensors`` files, by name."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def tensors_from_spec(spec: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Zero tensors from ``[[name, dtype, shape], ...]``."""
    return {
        str(name): torch.zeros(
            [int(d) for d in shape], dtype=parse_dtype(dtype, where=f"spec {name}")
        )
        for name, dtype, shape in spec
    }


class ReferenceEngine:
    """Serves the weight-sync endpoints over ``tensors`` (updated in place)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        device: str = "cpu",
        api_key: str | None = None,
        group_timeout_s: float = 60.0,
        die_on_update: int | None = None,
    ) -> None:
        self.tensors = {name: t.to(device) for name, t in tensors.items()}
        self.receiver = WeightReceiver(device=device)
        self.api_key = api_key
        self.group_timeout_s = group_timeout_s
        self.die_on_update = die_on_update
        self.weight_version = "default"
        self.in_session = False  # between /begin_weight_update and /end_weight_update
        self.paused_mode: str | None = None
        self.updates = 0
        self.adapters: dict[str, str] = {}  # LoRA: loaded adapter name -> its folder
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---------------------------------------------------------------- handlers

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        self.receiver.init_group(
            body["master_address"],
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            body["group_name"],
            body.get("backend", "gloo"),
            timeout_s=self.group_timeout_s,
        )
        return {"success": True, "message": f"joined {body['group_name']}"}

    def session(self, begin: bool) -> dict[str, Any]:
        with self._lock:
            if self.in_session == begin:
                raise ValueError(
                    "a weight-update session is already open; call end_weight_update() first"
                    if begin
                    else "no weight-update session is open; call begin_weight_update() first"
                )
            self.in_session = begin
        return {"success": True, "message": "Success"}

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.in_session:
            raise ValueError(
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        with self._lock:
            self.updates += 1
            if self.die_on_update is not None and self.updates >= self.die_on_update:
                log.error("fault injection: dying on update request %d", self.updates)
                os._exit(DIE_EXIT_CODE)

        def load(named: list[tuple[str, torch.Tensor]]) -> int:
            with self._lock:
                for name, tensor in named:
                    target = self.tensors.get(name)
                    if target is None:
                        raise ValueError(f"unknown tensor {name!r}")
                    if target.shape != tensor.shape or target.dtype != tensor.dtype:
                        raise ValueError(
                            f"tensor {name}: engine holds {target.dtype} {tuple(target.shape)}, "
                            f"update is {tensor.dtype} {tuple(tensor.shape)}"
                        )
                    target.copy_(tensor)
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
            return len(named)

        count = self.receiver.receive(
            body["names"],
            body["dtypes"],
            body["shapes"],
            body["group_name"],
            body.get("load_format"),
            load=load,
        )
        return {"success": True, "message": f"loaded {count} tensors"}

    def destroy(self, body: dict[str, Any]) -> dict[str, Any]:
        self.receiver.destroy(body["group_name"])
        return {"success": True, "message": "destroyed"}

    def rows(self, body: dict[str, Any]) -> Any:
        with self._lock:
            tensor = self.tensors.get(body["name"])
            if tensor is None:
                raise ValueError("Get parameter by name failed")
            return tensor[: int(body.get("truncate_size", 100))].to(torch.float32).tolist()

    def load_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's ``/load_lora_adapter``: read the folder, check it fits the table, hold it."""
        from weight_sync.adapters import read_adapter_folder

        name, path = str(body["lora_name"]), str(body["lora_path"])
        if name in self.adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        weights = read_adapter_folder(path)
        for module in weights.a:
            target = self.tensors.get(f"{module}.weight")
            if target is None or tuple(weights.delta(module).shape) != tuple(target.shape):
                raise ValueError(f"adapter {name}: module {module!r} does not fit this model")
        with self._lock:
            self.adapters[name] = path
        return {"success": True, "error_message": "", "loaded_adapters": dict(self.adapters)}

    def unload_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body["lora_name"])
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise ValueError(
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
                )
        return {"success": True, "error_message": "", "loaded_adapters": dict(self.adapters)}

    def save(self, body: dict[str, Any]) -> dict[str, Any]:
        from safetensors.torch import save_file

        with self._lock:
            save_file({n: t.contiguous().cpu() for n, t in self.tensors.items()}, body["path"])
        return {"success": True, "message": body["path"]}

    def route(self, method: str, path: str, body: dict[str, Any]) -> Any:
        if method == "GET":
            if path in ("/health", "/health_generate"):
                return {"success": True}
            if path == "/model_info":
                return {"model_path": "reference", "weight_version": self.weight_version}
        else:
            if path == "/begin_weight_update":
                return self.session(begin=True)
            if path == "/end_weight_update":
                return self.session(begin=False)
            if path == "/get_weights_by_name":
                return self.rows(body)
            if path == "/flush_cache":
                return {"success": True, "message": "Cache flushed."}
            if path == "/init_weights_update_group":
                return self.init_group(body)
            if path == "/update_weights_from_distributed":
                return self.update(body)
            if path == "/destroy_weights_update_group":
                return self.destroy(body)
            if path == "/pause_generation":
                self.paused_mode = str(body.get("mode", "abort"))
                return {"success": True, "message": f"paused ({self.paused_mode})"}
            if path == "/continue_generation":
                self.paused_mode = None
                return {"success": True, "message": "continued"}
            if path == "/update_weight_version":
                self.weight_version = str(body["new_version"])
                return {"success": True, "new_version": self.weight_version}
            if path == "/load_lora_adapter":
                return self.load_adapter(body)
            if path == "/unload_lora_adapter":
                return self.unload_adapter(body)
            if path == "/fleetrl/reference/save":
                return self.save(body)
        raise _NoRoute(f"{method} {path}")

    # ---------------------------------------------------------------- server

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a daemon thread; returns the base URL."""
        if host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"refusing to serve on {host} without an api key")
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("%s " + fmt, self.address_string(), *args)

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                if (
                    engine.api_key
                    and self.headers.get("Authorization") != f"Bearer {engine.api_key}"
                ):
                    self._reply(
                        HTTPStatus.UNAUTHORIZED, {"success": False, "message": "bad api key"}
                    )
                    return
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
                    self._reply(HTTPStatus.OK, engine.route(method, self.path, body))
                except _NoRoute as err:
                    self._reply(
                        HTTPStatus.NOT_FOUND, {"success": False, "message": f"no route {err}"}
                    )
                except (ValueError, KeyError, TypeError, RuntimeError) as err:
                    log.warning("%s %s failed: %s", method, self.path, err)
                    self._reply(
                        HTTPStatus.BAD_REQUEST,
                        {"success": False, "message": f"{type(err).__name__}: {err}"},
                    )

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, name="reference-engine", daemon=True
        ).start()
        bound_host, bound_port = self._server.server_address[:2]
        return f"http://{bound_host}:{bound_port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.receiver.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face model folder (*.safetensors)")
    source.add_argument("--spec", help="JSON file: [[name, dtype, shape], ...]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", help="write the bound port here once serving")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--group-timeout-s", type=float, default=60.0)
    parser.add_argument("--die-on-update", type=int, default=None)
    args = parser.parse_args(argv)
    setup_logging(role="reference-engine")
    torch.set_num_threads(1)
    tensors = (
        load_safetensors_dir(args.model)
        if args.model
        else tensors_from_spec(json.loads(Path(args.spec).read_text()))
    )
    engine = ReferenceEngine(
        tensors,
        device=args.device,
        api_key=args.api_key,
        group_timeout_s=args.group_timeout_s,
        die_on_update=args.die_on_update,
    )
    url = engine.start_server(args.host, args.port)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(url.rsplit(":", 1)[1])
        tmp.replace(args.port_file)  # atomic: readers never see a partial file
    log.info("reference engine serving %d tensors at %s", len(tensors), url)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
