"""A torch.profiler span written as a Chrome trace (``trainer.profile_steps``).

``TraceSpan.start()`` begins recording this process's CPU activity (and CUDA kernels
where CUDA is in use); ``stop(path)`` ends it and writes ``path``, Chrome's trace-event
JSON (``chrome://tracing``, https://ui.perfetto.dev). The learner ranks record the listed
steps; the embedded engine records the same span behind SGLang's ``/start_profile`` and
``/stop_profile`` routes. Left out: memory snapshots, stacks and shapes (large, slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TraceSpan:
    def __init__(self) -> None:
        self._profiler: Any = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self, cuda: bool | None = None) -> None:
        """Begin a span (one at a time); ``cuda`` None: record kernels when CUDA is there."""
        import torch

        if self._profiler is not None:
            raise RuntimeError("a profile is already being recorded")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda if cuda is not None else torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # every thread: the engine's scheduler runs the model on its own thread, a Ray actor's
        # calls may not run on the one that started the span
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        self._profiler = torch.profiler.profile(
            activities=activities, experimental_config=every_thread
        )
        self._profiler.start()

    def stop(self, path: str | Path) -> Path:
        """End the span and write it to ``path`` (folders made); returns the path. Call it on
        the thread that started the span (torch.profiler crashes otherwise)."""
        if self._profiler is None:
            raise RuntimeError("no profile is being recorded")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(out))
        return out


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where the traces of one profiled step go: ``<run dir>/profile/step_<N>``."""
    return Path(run_dir) / "profile" / f"step_{step}"
