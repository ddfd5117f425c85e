"""A local Ray instance started beside the preflight's slow checks.

``fleetrl train`` checks everything before it starts anything. The checks that import
transformers (prompts rendered with the tokenizer, the model family built on the meta
device, the reward function run on rows) keep one core busy for seconds while the
machine's others idle, and a local Ray instance takes seconds more to start, most of them
in Ray's own processes. So once the quick checks have passed, the instance starts on a
thread beside the slow ones; when a slow check fails, the instance is ended before the
failure is reported, and a refused run leaves nothing running. Joining a cluster (an
address) is not done early: it is quick, and that cluster is not the run's to start.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from fleetrl.log import get_logger
from fleetrl.machine import usable_cpus
from launcher.config import RunConfig

log = get_logger(__name__)

# Ray's line when ray.init runs off the main thread: the run's own handler is in force
_THREAD_WARNING = "SIGTERM handler is not set"


class _DropThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _THREAD_WARNING not in record.getMessage()


def starts_local_instance(cfg: RunConfig, address: str | None) -> bool:
    """Whether the run starts a local instance (no address anywhere), the only case started early."""
    return not (address or cfg.ray.address or os.environ.get("RAY_ADDRESS"))


class EarlyRay:
    """One early start of the run's local Ray instance: ``begin`` it, ``result`` when the
    session takes it over, ``end`` when the run ends or will not start.

    The thread that starts the instance stays until ``end``: Ray's processes are told to
    die with the thread that started them (Linux's parent-death signal follows the thread,
    not the process), so a thread that returned would take the instance with it.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self._user_omp = os.environ.get("OMP_NUM_THREADS")  # before the start sets the roles'
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._release = threading.Event()
        self._started = False
        self._error: BaseException | None = None

    @property
    def begun(self) -> bool:
        return self._thread is not None

    def begin(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._start, name="early-ray", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        from launcher.placement import init_ray

        quiet = _DropThreadWarning()
        ray_log = logging.getLogger("ray._private.worker")
        ray_log.addFilter(quiet)
        try:
            self._started = init_ray(self.cfg, None)
        except BaseException as err:  # handed to the thread that takes the instance over
            self._error = err
        finally:
            ray_log.removeFilter(quiet)
            self._ready.set()
        self._release.wait()  # Ray's processes live as long as this thread

    def keep_driver_threads(self) -> None:
        """Give this process's torch the threads it would have had without the early start.

        While Ray starts its processes this process's environment holds the roles'
        ``OMP_NUM_THREADS=1`` (they inherit it); a torch first imported meanwhile, by a slow
        check, sizes its thread pool from it, and the driver's own torch work after the
        checks (building the demo's model and its warm start) would run on one thread.
        """
        torch = sys.modules.get("torch")
        if torch is None or self._thread is None:
            return
        user = self._user_omp
        threads = int(user) if user and user.isdigit() and int(user) > 0 else usable_cpus()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def result(self) -> bool:
        """Wait for the start; True when this process started the instance; its error raised."""
        if self._thread is None:
            raise RuntimeError("EarlyRay.result() before begin()")
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._started

    def end(self) -> None:
        """Wait for the start to finish, end the instance if it is still up, let the
        thread go. Safe after the session ended the instance itself, and more than once."""
        if self._thread is None or self._release.is_set():
            return
        self._ready.wait()
        import ray

        if ray.is_initialized():
            from launcher.placement import shutdown_local_ray

            shutdown_local_ray()
            log.info("the local Ray instance started beside the checks is ended")
        self._release.set()
        self._thread.join()
