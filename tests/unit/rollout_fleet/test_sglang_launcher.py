"""SGLang launcher: the command line it builds, the unavailable path, and process lifecycle.

The lifecycle tests run a stand-in ``sglang.launch_server`` module (a tiny HTTP
server answering /health) from a temporary folder, so starting, health
waiting, bounded restarts and stopping by process group are exercised for real
without SGLang or a GPU. That SGLang's own parser accepts every command line
is proven in tests/conformance/test_sglang_launcher_flags.py; a real server on a
GPU is started by ``make gpu-check``.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout_fleet.sglang_launcher import (
    SGLangServer,
    SGLangServerSpec,
    SGLangStartError,
    SGLangUnavailable,
    build_command,
    check_available,
    radix_cache_disabled_for,
    remove_key_config,
    write_key_config,
)

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, json, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--config", default=None)  # SGLang's: YAML, api_key among its keys
    args, _ = parser.parse_known_args()
    args.api_key = None
    if args.config:
        line = open(args.config).read().strip()
        assert line.startswith("api-key: ")
        args.api_key = json.loads(line.removeprefix("api-key: "))
    if os.environ.get("FAKE_SGLANG_EXIT"):
        sys.exit(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /health is open, as SGLang's
            authorized = self.headers.get("Authorization") == "Bearer " + str(args.api_key)
            if args.api_key and self.path != "/health" and not authorized:
                self.send_response(401); self.end_headers(); return
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_sglang(tmp_path):
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    return {"PYTHONPATH": str(tmp_path)}


def test_command_has_sglang_argument_names_and_dummy_load_by_default():
    spec = SGLangServerSpec(model_path="/m", port=31000, tp_size=2, mem_fraction_static=0.7)
    cmd = build_command(spec)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert pairs["--model-path"] == "/m"
    assert pairs["--port"] == "31000"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--tp-size"] == "2"
    assert pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--load-format"] == "dummy"
    assert pairs["--weight-version"] == "0"
    assert "--api-key" not in cmd
    assert "--disable-radix-cache" not in cmd


def test_in_place_pause_disables_the_radix_cache_and_the_others_keep_it():
    assert radix_cache_disabled_for("in_place") is True
    assert radix_cache_disabled_for("abort") is False
    assert radix_cache_disabled_for("retract") is False
    spec = SGLangServerSpec(model_path="/m", port=31000, disable_radix_cache=True)
    assert "--disable-radix-cache" in build_command(spec)


def test_command_with_real_weights_key_and_extra_args(tmp_path):
    spec = SGLangServerSpec(
        model_path="/m",
        host="10.0.0.5",
        port=31000,
        api_key="secret",
        load_format="auto",
        max_running_requests=32,
        random_seed=7,
        base_gpu_id=1,
        extra_args=["--attention-backend", "fa3"],
    )
    with pytest.raises(ValueError, match="never argv"):
        build_command(spec)
    key_file = write_key_config("secret")
    try:
        cmd = build_command(spec, key_file)
        assert (key_file.stat().st_mode & 0o777, key_file.parent.stat().st_mode & 0o777) == (0o600, 0o700)  # fmt: skip
    finally:
        remove_key_config(key_file)
    assert not key_file.parent.exists()
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert pairs["--load-format"] == "auto"
    assert pairs["--config"] == str(key_file) and "--api-key" not in cmd
    assert "secret" not in " ".join(cmd) and "secret" not in repr(spec)
    assert pairs["--max-running-requests"] == "32"
    assert pairs["--random-seed"] == "7"
    assert pairs["--base-gpu-id"] == "1"
    assert cmd[-2:] == ["--attention-backend", "fa3"]


def test_non_loopback_host_without_api_key_is_refused():
    with pytest.raises(ValueError, match="api_key"):
        build_command(SGLangServerSpec(model_path="/m", host="0.0.0.0", port=1))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("tp_size", 0, "tp_size"),
        ("mem_fraction_static", 1.5, "mem_fraction"),
        ("load_format", "pt", "load_format"),
    ],
)
def test_bad_spec_values_are_named(field, value, match):
    spec = SGLangServerSpec(model_path="/m", port=1)
    setattr(spec, field, value)
    with pytest.raises(ValueError, match=match):
        spec.validate()


def test_port_zero_must_be_resolved_before_building_the_command():
    with pytest.raises(ValueError, match="port"):
        build_command(SGLangServerSpec(model_path="/m"))


def test_missing_sglang_raises_sglang_unavailable_with_a_hint(monkeypatch):
    with pytest.raises(SGLangUnavailable, match="not installed.*rollout.backend=embedded"):
        check_available(lookup=lambda: None)
    monkeypatch.setattr("rollout_fleet.sglang_launcher.installed_sglang_version", lambda: None)
    server = SGLangServer(SGLangServerSpec(model_path="/m"))
    with pytest.raises(SGLangUnavailable, match=r'pip install "\.\[sglang\]" in fleetrl'):
        server.start()
    assert server.pid is None


def test_an_untested_sglang_release_is_refused_at_start_in_one_line():
    with pytest.raises(SGLangUnavailable) as info:
        check_available(lookup=lambda: "0.4.6")
    message = str(info.value)
    assert "\n" not in message
    assert "sglang 0.4.6 is installed" in message and ">=0.5.23,<0.5.24" in message


def test_server_starts_waits_for_health_and_stops_by_process_group(fake_sglang):
    import urllib.error
    import urllib.request

    key = "run-key-0123456789"
    spec = SGLangServerSpec(model_path="/m", api_key=key)
    server = SGLangServer(spec, require_available=False, env=fake_sglang, startup_timeout_s=60)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        assert server.alive() and server.health()
        pid = server.pid
        assert os.getpgid(pid) == pid  # its own process group
        # the key reached the server by its file, which is gone once the server read it
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert server._key_config is None
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{url}/model_info", timeout=10)
    finally:
        server.stop(timeout_s=10)
    assert not server.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_server_that_exits_is_restarted_a_bounded_number_of_times(fake_sglang, tmp_path):
    env = {**fake_sglang, "FAKE_SGLANG_EXIT": "1"}
    log_path = tmp_path / "sglang.log"
    server = SGLangServer(
        SGLangServerSpec(model_path="/m"),
        require_available=False,
        env=env,
        max_restarts=1,
        startup_timeout_s=30,
        log_path=log_path,
    )
    with pytest.raises(SGLangStartError, match="2 attempts.*status 3"):
        server.start()
    assert server.restarts == 1
    assert not server.alive()


def test_ensure_running_restarts_an_exited_server(fake_sglang):
    server = SGLangServer(
        SGLangServerSpec(model_path="/m"), require_available=False, env=fake_sglang
    )
    server.start()
    try:
        assert server.ensure_running() is False
        first_pid = server.pid
        os.killpg(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.ensure_running() is True
        assert server.pid != first_pid and server.health()
    finally:
        server.stop(timeout_s=10)
