"""The ``fleetrl`` program's exit (``launcher.cli.console``): it skips the interpreter's
teardown, yet every line printed reaches a pipe, the exit handlers run, the status is
``main()``'s, and a thread still working is waited for."""

from __future__ import annotations

import subprocess
import sys

from bench.common import REPO_ROOT

# a program that registers an exit handler, then runs the `fleetrl` program on its arguments;
# with --with-thread, a thread that is still working when the command's main() returns (it
# starts its last 0.2 s of work then, whatever the machine's speed)
PROGRAM = """
import atexit, sys, threading, time
atexit.register(lambda: print("exit handler ran", flush=True))
import launcher.cli as cli
if sys.argv[1] == "--with-thread":
    sys.argv.pop(1)
    ended = threading.Event()
    command = cli.main
    def main():
        try:
            return command()
        finally:
            ended.set()
    cli.main = main
    def late():
        ended.wait(60)
        time.sleep(0.2)
        print("thread finished", flush=True)
    threading.Thread(target=late).start()
sys.argv[0] = "fleetrl"
cli.console()
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_commands_whole_output_reaches_the_pipe_then_the_exit_handlers_run():
    done = _run("config", "show", "--config", "configs/demo_cpu.yaml")
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert shown[-1] == "exit handler ran"
    # the whole config, to its last section, before the handler's line
    assert len(shown) > 50
    assert any(line.startswith("trainer:") for line in shown)


def test_the_status_is_mains_for_bad_input():
    done = _run("config", "show", "--config", "configs/no_such.yaml")
    assert done.returncode == 2
    assert "fleetrl: " in done.stderr and "no_such.yaml" in done.stderr
    assert done.stdout.splitlines()[-1] == "exit handler ran"


def test_a_thread_still_working_is_waited_for():
    done = _run("--with-thread", "config", "show", "--config", "configs/demo_cpu.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["thread finished", "exit handler ran"]
