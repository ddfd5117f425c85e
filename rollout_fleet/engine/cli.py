"""`fleetrl engine` / `python -m rollout_fleet.engine.cli`: serve the embedded engine until interrupted.

The folder picks the engine (``kinds.open_engine``): a causal LM is served on ``/generate``,
a ``*ForSequenceClassification`` reward model on ``/classify`` and ``/encode``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from fleetrl.log import get_logger
from rollout_fleet.engine.cli_args import add_engine_arguments
from rollout_fleet.engine.http_service import EngineStartupError, resolve_api_key
from rollout_fleet.engine.kinds import open_engine

log = get_logger(__name__)


def main(args: argparse.Namespace) -> int:
    """``fleetrl engine``: serve until interrupted. Returns the exit status."""
    try:
        # a server started by hand requires a key too, loopback included: anyone on the host
        # could otherwise drive it
        key = resolve_api_key(args.host, args.api_key, require_api_key=True)
        engine = open_engine(
            args.model,
            engine_id=args.engine_id,
            device=args.device,
            max_running_requests=args.max_running_requests,
            api_key=key,
            log_requests=args.log_requests,
            max_batch_tokens=args.max_batch_tokens,
            memory_saver=args.enable_memory_saver,
        )
    except (EngineStartupError, FileNotFoundError, ValueError) as err:
        log.error("engine: %s", err)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await engine.serve(args.host, args.port)
        await stop.wait()
        log.info("%s: shutting down", engine.engine_id)
        await engine.shutdown()

    try:
        asyncio.run(run())
    except OSError as err:
        log.error("engine: cannot serve on %s:%s: %s", args.host, args.port, err)
        return 2
    finally:
        engine.stop()
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rollout_fleet.engine.cli", description=__doc__.split("\n")[0]
    )
    add_engine_arguments(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    from fleetrl.log import setup_logging

    setup_logging("engine")
    sys.exit(main(_parse(None)))
