"""A quiet console: roles show warnings on the console and log everything to their file."""

from __future__ import annotations

from fleetrl.log import CONSOLE_LEVEL_ENV, LOG_DIR_ENV, get_logger, role_env, setup_logging


def test_role_console_shows_warnings_and_its_file_gets_every_line(tmp_path, monkeypatch, capsys):
    for key, value in role_env("warning", tmp_path).items():
        monkeypatch.setenv(key, value)
    try:
        setup_logging("engine:engine-0", "INFO")
        log = get_logger("rollout_fleet.test")
        log.debug("below the level")
        log.info("weights v3 in 1 bucket")
        log.warning("engine-1 missed a version")
        console = capsys.readouterr().err
        assert "engine-1 missed a version" in console and "weights v3" not in console
        text = (tmp_path / "engine-engine-0.log").read_text()
        assert "weights v3 in 1 bucket" in text and "engine-1 missed a version" in text
        assert "below the level" not in text and "[engine:engine-0]" in text
    finally:
        monkeypatch.undo()
        setup_logging("main")  # back to a plain console handler, file closed


def test_driver_console_keeps_info_without_the_role_environment(monkeypatch, capsys):
    monkeypatch.delenv(CONSOLE_LEVEL_ENV, raising=False)
    monkeypatch.delenv(LOG_DIR_ENV, raising=False)
    setup_logging("train", "INFO")
    get_logger("launcher.tracking").info("step 5/40 | v5")
    assert "step 5/40 | v5" in capsys.readouterr().err
