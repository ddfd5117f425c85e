"""The HTTP process: SGLang's own FastAPI app, served by uvicorn, over our backend.

Set up as SGLang's ``_setup_and_run_http_server`` does for a single tokenizer:
``ServerArgs`` published under the tokenizer role (the real handlers read the
config bags: ``/model_info``'s ``weight_version``, the API key), the global
state set with ``set_global_state``, ``app.is_single_tokenizer_mode`` and
``app.server_args``, and SGLang's ``add_api_key_middleware`` added under the
same condition (``--api-key`` / ``--admin-api-key``): a request without the
bearer key gets 401 from SGLang's middleware. The app's lifespan is replaced
with one that starts our reader threads, skipping the tokenizer-worker and
warm-up start that needs a real scheduler; serving a reward model it also builds
SGLang's ``OpenAIServingClassify`` (``/v1/classify``), as SGLang's lifespan does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    model_dir: str
    tp_size: int
    port: int
    api_key: str | None = None
    host: str = "127.0.0.1"
    lora_rank: int = 0  # > 0: LoRA on (rank.lora_server_args)
    is_embedding: bool = False  # a reward model, served on /classify and /encode


def build_app(cfg: HttpConfig, conns: list[Connection]):
    """Publish the config, install our backend as SGLang's tokenizer manager, return the app."""
    import asyncio

    from sglang.srt.entrypoints import http_server
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.runtime_context import get_serving, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.auth import add_api_key_middleware, app_has_admin_force_endpoints

    from .backend import EngineBackend
    from .rank import lora_server_args

    server_args = ServerArgs(
        model_path=cfg.model_dir,
        device="cpu",
        load_format="dummy",
        tp_size=cfg.tp_size,
        api_key=cfg.api_key,
        host=cfg.host,
        port=cfg.port,
        is_embedding=cfg.is_embedding,
        **lora_server_args(cfg.lora_rank),
    )
    publish(server_args, role="tokenizer")
    backend = EngineBackend(server_args, conns)
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=backend,
            template_manager=TemplateManager(),
            scheduler_info={
                "max_req_input_len": backend.max_req_input_len,
                "startup_time": backend.startup_time,
            },
        )
    )
    app = http_server.app

    @asynccontextmanager
    async def lifespan(_app):
        backend.start(asyncio.get_running_loop())
        if cfg.is_embedding:  # SGLang's lifespan builds it; /v1/classify needs it
            from sglang.srt.entrypoints.openai.serving_classify import OpenAIServingClassify

            _app.state.openai_serving_classify = OpenAIServingClassify(
                backend, http_server._global_state.template_manager
            )
        yield

    app.router.lifespan_context = lifespan
    app.is_single_tokenizer_mode = True
    app.server_args = server_args
    if get_serving().api_key or get_serving().admin_api_key or app_has_admin_force_endpoints(app):
        add_api_key_middleware(
            app, api_key=get_serving().api_key, admin_api_key=get_serving().admin_api_key
        )
    return app


def http_main(cfg: HttpConfig, conns: list[Connection]) -> None:
    """Process entry (spawn target)."""
    import warnings

    import uvicorn

    # SGLang's handlers use ORJSONResponse, which this FastAPI deprecates: not ours to fix
    warnings.filterwarnings("ignore", message="ORJSONResponse is deprecated")
    logging.basicConfig(
        level=os.environ.get("SGLANG_ENGINE_LOG_LEVEL", "WARNING"),
        format="[http] %(levelname)s %(name)s: %(message)s",
    )
    app = build_app(cfg, conns)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_keep_alive=30)
