"""Every command the README and docs/*.md show does what its text says, in reading order.

The commands run from the root of a reader's checkout: a copy of this one's files (its
``runs/`` left behind, so nothing of a developer's runs is touched) sharing its virtualenv,
with ``fleetrl`` on PATH. How each command runs is in docs_table.py; one no table names
fails here with its file and line. Slow: the demos run whole (``make demo``, ``make
demo-rm``, ``make demo-elastic``), each step's time printed at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from tests.e2e.docs_commands import DocCommand, doc_commands
from tests.e2e.docs_table import (
    DOC_COMMANDS,
    PREREQUISITES,
    SUBSTITUTIONS,
    Excluded,
    Export,
    Findings,
    Run,
    Serve,
    Training,
    ViaCheck,
    key,
)

REPO = Path(__file__).resolve().parents[2]
COMMANDS = doc_commands(REPO)
COMMAND_TIMEOUT_S = 1800
READY_TIMEOUT_S = 600


def _unclassified() -> list[str]:
    return [f"{c.where()}: {c.text}" for c in COMMANDS if key(c.text) not in DOC_COMMANDS]


def test_every_documented_command_is_classified():
    missing = _unclassified()
    assert not missing, "commands the docs show that tests/e2e/docs_table.py does not classify:\n" + "\n".join(missing)  # fmt: skip


def test_every_classified_command_is_still_documented():
    shown = {key(c.text) for c in COMMANDS}
    stale = [k for k in DOC_COMMANDS if key(k) not in shown]
    assert not stale, f"docs_table.py classifies commands no doc shows: {stale}"


def test_every_exclusion_names_a_test_that_exists():
    for text, how in DOC_COMMANDS.items():
        if isinstance(how, Excluded):
            assert (REPO / how.covered_by).exists(), f"{text!r}: {how.covered_by} missing"


def test_background_commands_are_servers_or_runs():
    for c in COMMANDS:
        if c.background:
            assert isinstance(DOC_COMMANDS.get(key(c.text)), Serve | Training | Excluded), c.where()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reader_checkout(dest: Path) -> Path:
    """This checkout's files (tracked and new, with their times, so make's stamp holds)
    and its virtualenv, without its runs/."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    return dest


def _gsm8k_raw(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split, n in (("train", 6), ("test", 3)):
        rows = [
            {
                "question": f"Tom has {i} apples and buys 2. How many?",
                "answer": f"{i}+2\n#### {i + 2}",
            }  # fmt: skip
            for i in range(n)
        ]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


class Reader:
    """Runs the documented commands in the reader's checkout, one shell each."""

    def __init__(self, root: Path, fixtures: dict[str, str]):
        self.root = root
        self.fixtures = fixtures
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{self.env['PATH']}"
        self.env["WANDB_MODE"] = "offline"
        self.logs = root / "runs" / "docs" / "logs"
        self.logs.mkdir(parents=True)
        self.times: list[tuple[str, str, float]] = []

    def substitute(self, text: str) -> str:
        for old, new, _why in SUBSTITUTIONS:
            text = text.replace(old, new.format(**self.fixtures))
        return text

    def start(self, c: DocCommand, text: str) -> subprocess.Popen:
        log = open(self.logs / f"{c.file.replace('/', '_')}_{c.line}.log", "w")  # noqa: SIM115
        return subprocess.Popen(
            ["bash", "-c", text], cwd=self.root, env=self.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def run(self, c: DocCommand, text: str, timeout: float = COMMAND_TIMEOUT_S):
        """Runs one command to its end; whatever stops the test ends its processes too."""
        began = time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", text], cwd=self.root, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _stop(proc)
        self.times.append((c.where(), text, time.monotonic() - began))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _tail(done: subprocess.CompletedProcess) -> str:
    return (done.stdout + done.stderr)[-3000:]


def _assert_findings(c: DocCommand, done: subprocess.CompletedProcess):
    out = done.stdout + done.stderr
    assert "Traceback" not in out, f"{c.where()} {c.text}: a traceback\n{_tail(done)}"
    assert done.returncode in (0, 2), f"{c.where()} {c.text}: exit {done.returncode}\n{_tail(done)}"  # fmt: skip
    if done.returncode == 2:
        findings = [ln for ln in done.stderr.splitlines() if ln.startswith("fleetrl: ")]
        assert findings, f"{c.where()} {c.text}: exit 2 without a finding\n{_tail(done)}"


def _check_args(text: str) -> tuple[str, list[str]]:
    """The ``--config``, ``--address`` and overrides of the fleetrl run a command starts,
    itself or as the quoted command it hands on (``ray exec '...'``)."""
    words = shlex.split(text)
    quoted = [w for w in words if " --config " in f" {w} "]
    if quoted and quoted[0] != "--config":
        words = shlex.split(quoted[0])
    at = words.index("--config")
    rest = []
    if "--address" in words:
        rest += ["--address", words[words.index("--address") + 1]]
    rest += [w for w in words[at + 2 :] if "=" in w and not w.startswith("-")]
    return words[at + 1], rest


def _wait_port(proc: subprocess.Popen, port: int, where: str):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{where}: the server exited {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"{where}: nothing listens on port {port}")


def _wait_file(proc: subprocess.Popen, path: Path, where: str):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None, f"{where}: the run exited {proc.returncode} before {path}"
        assert time.monotonic() < deadline, f"{where}: no {path}"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen):
    """Ends a server the test started: its process group, by its pid."""
    with suppress(ProcessLookupError):  # the group's leader ended, members may be left
        os.killpg(proc.pid, signal.SIGTERM)
    if proc.poll() is None:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _one(reader: Reader, c: DocCommand, how, started: list):
    text = reader.substitute(c.text)
    if isinstance(how, Run):
        text = " ".join([text, *how.reduced])
        done = reader.run(c, text)
        assert done.returncode == 0, f"{c.where()} {c.text}: exit {done.returncode}\n{_tail(done)}"  # fmt: skip
        for rel in how.writes:
            assert (reader.root / rel).exists(), f"{c.where()} {c.text}: wrote no {rel}"
        if how.prints_json is not None:
            assert isinstance(json.loads(done.stdout), how.prints_json), done.stdout[:500]
    elif isinstance(how, Export):
        done = reader.run(c, f'{text}\nprintf %s "${how.name}"')
        assert done.returncode == 0 and done.stdout, f"{c.where()} {c.text}: {_tail(done)}"
        reader.env[how.name] = done.stdout
    elif isinstance(how, Findings):
        _assert_findings(c, reader.run(c, text))
    elif isinstance(how, ViaCheck):
        config, rest = _check_args(text)
        show = reader.run(c, shlex.join(["fleetrl", "config", "show", "--config", config, *[r for r in rest if "=" in r]]))  # fmt: skip
        assert show.returncode == 0, f"{c.where()} config show: {_tail(show)}"
        _assert_findings(c, reader.run(c, shlex.join(["fleetrl", "check", "--config", config, *rest])))  # fmt: skip
    elif isinstance(how, Serve):
        proc = reader.start(c, text)
        _wait_port(proc, int(shlex.split(text)[shlex.split(text).index("--port") + 1]), c.where())
        started.append((c, how, proc, time.monotonic()))
    elif isinstance(how, Training):
        proc = reader.start(c, text)
        started.append((c, how, proc, time.monotonic()))
        _wait_file(proc, reader.root / how.ready, c.where())


def _end_block(reader: Reader, started: list, blocks_left: dict):
    for entry in list(started):
        c, how, proc, began = entry
        if isinstance(how, Training):
            rc = proc.wait(COMMAND_TIMEOUT_S)
            reader.times.append((c.where(), c.text, time.monotonic() - began))
            assert rc == 0, f"{c.where()} {c.text}: exit {rc}"
            started.remove(entry)
        elif blocks_left.setdefault(id(proc), how.more_blocks) == 0:
            _stop(proc)
            started.remove(entry)
        else:
            blocks_left[id(proc)] -= 1


@pytest.mark.slow
@pytest.mark.timeout(4800)  # the demos whole, under load: ~20-40 min on 2 cores
def test_every_documented_command_does_what_its_text_says(tmp_path):
    assert not _unclassified(), "unclassified commands: see the test above"
    root = _reader_checkout(tmp_path / "checkout")
    fixtures = {
        "gsm8k_raw": str(_gsm8k_raw(tmp_path / "gsm8k_raw")),
        "port_classify": str(_free_port()),
        "port_rm": str(_free_port()),
    }
    reader = Reader(root, fixtures)
    started: list = []
    blocks_left: dict = {}
    try:
        for i, c in enumerate(COMMANDS):
            how = DOC_COMMANDS[key(c.text)]
            pre = PREREQUISITES.get(key(c.text))
            if pre and not (pre.unless and (root / pre.unless).exists()):
                done = reader.run(c, pre.command)
                assert done.returncode == 0, f"before {c.where()}: {pre.command}\n{_tail(done)}"
            if not isinstance(how, Excluded):
                _one(reader, c, how, started)
            if i + 1 == len(COMMANDS) or COMMANDS[i + 1].block != c.block:
                _end_block(reader, started, blocks_left)
    finally:
        for _c, _how, proc, _began in started:
            _stop(proc)
        print("\ndocs commands, seconds each:")
        for where, text, seconds in reader.times:
            print(f"{seconds:8.1f}  {where}  {text[:110]}")
