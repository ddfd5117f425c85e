"""The slow preflight checks remembered by their inputs: a pass is read back instead of checked
again (a driver that never imports torch), anything it read that changes checks again, a
failure is never remembered, and ``FLEETRL_CACHE_DIR=off`` checks every time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from launcher import preflight
from launcher.config import load_run_config
from launcher.preflight_findings import Finding
from launcher.preflight_memo import cache_dir, remembered
from launcher.preflight_memo import folder_signature as signature

WARNING = Finding(key="learner.packing", problem="pads", fix="none", fatal=False)
ERROR = Finding(key="model.path", problem="broken", fix="fix it")


@pytest.fixture
def memo(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FLEETRL_CACHE_DIR", str(folder))
    return folder


class Counted:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self):
        self.calls += 1
        return self.result


def _remember(check, folder, **inputs):
    return remembered(
        "family",
        check,
        inputs=inputs,
        folders=[folder],
        result_type=list[Finding],
        keep=lambda found: not any(f.fatal for f in found),
    )


def test_a_passed_check_is_read_back_warnings_included(memo, tmp_path):
    (tmp_path / "model").mkdir()
    check = Counted([WARNING])
    assert _remember(check, tmp_path / "model", n=1) == ([WARNING], False)
    assert _remember(check, tmp_path / "model", n=1) == ([WARNING], True)
    assert check.calls == 1
    assert len(list((memo / "preflight").glob("*.json"))) == 1


def test_a_failed_check_is_never_remembered(memo, tmp_path):
    check = Counted([WARNING, ERROR])
    for _ in range(2):
        assert _remember(check, tmp_path, n=1) == ([WARNING, ERROR], False)
    assert check.calls == 2
    assert not (memo / "preflight").exists()


def test_a_changed_file_input_or_new_file_checks_again(memo, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    check = Counted([])
    _remember(check, model, n=1)
    (model / "tokenizer.json").write_text('{"a": 1}')  # size and time change
    _remember(check, model, n=1)
    os.utime(model / "tokenizer.json", ns=(1, 1))  # same size, another time
    _remember(check, model, n=1)
    (model / "sub").mkdir()
    (model / "sub" / "chat_template.jinja").write_text("x")  # a file below the top level
    _remember(check, model, n=1)
    _remember(check, model, n=2)  # another input
    assert check.calls == 5
    _remember(check, model, n=2)
    assert check.calls == 5


def test_off_checks_every_time_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETRL_CACHE_DIR", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() is None
    check = Counted([])
    for _ in range(2):
        assert _remember(check, tmp_path, n=1) == ([], False)
    assert check.calls == 2 and not any(tmp_path.rglob("*.json"))


def test_default_place_follows_xdg_then_home(tmp_path):
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "fleetrl" / "preflight"
    assert cache_dir({"FLEETRL_CACHE_DIR": str(tmp_path)}) == tmp_path / "preflight"


def test_an_unreadable_entry_is_checked_again_and_replaced(memo, tmp_path):
    check, model = Counted([WARNING]), tmp_path / "model"
    model.mkdir()
    _remember(check, model, n=1)
    [entry] = (memo / "preflight").glob("*.json")
    entry.write_text("{not json")
    assert _remember(check, model, n=1) == ([WARNING], False)
    assert _remember(check, model, n=1) == ([WARNING], True)
    assert check.calls == 2


def test_an_input_json_cannot_hold_is_checked_not_remembered(memo, tmp_path):
    check = Counted([])
    for _ in range(2):
        assert _remember(check, tmp_path, row=object()) == ([], False)
    assert check.calls == 2


def test_a_missing_folder_is_part_of_the_key(tmp_path):
    assert signature(tmp_path / "absent") == ["missing", str(tmp_path / "absent")]
    (tmp_path / "absent").mkdir()
    assert signature(tmp_path / "absent")[1] == []


def _run_cfg(tmp_path, model, *overrides):
    return load_run_config(
        "configs/demo_cpu.yaml",
        [
            f"model.path={model}",
            "model.create_tiny=false",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'test.parquet'}]",
            f"trainer.output_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def test_the_model_checks_run_once_for_an_unchanged_model(memo, tmp_path, tiny_model_dir, monkeypatch):  # fmt: skip
    from launcher.prepare import ensure_data

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    cfg = _run_cfg(tmp_path, model)
    ensure_data(cfg)
    rows = preflight.data_rows(cfg)
    calls = {"rendering": 0, "family": 0}

    def counting(name, real):
        def check(*args):
            calls[name] += 1
            return real(*args)

        return check

    monkeypatch.setattr(preflight, "check_rendering", counting("rendering", preflight.check_rendering))  # fmt: skip
    monkeypatch.setattr(preflight, "check_model_family", counting("family", preflight.check_model_family))  # fmt: skip
    assert preflight.check_model_files(cfg, rows.samples) == ([], [])
    assert preflight.check_model_files(_run_cfg(tmp_path, model, "data.seed=7"), rows.samples) == ([], [])  # fmt: skip
    assert calls == {"rendering": 1, "family": 1}
    # a longer prompt allowance is another input of both; the rows rendered are rendering's
    preflight.check_model_files(_run_cfg(tmp_path, model, "data.max_prompt_length=59"), rows.samples)  # fmt: skip
    preflight.check_model_files(cfg, rows.samples[:1])
    assert calls == {"rendering": 3, "family": 2}


def test_a_second_check_of_the_same_run_never_imports_torch(memo, tmp_path, tiny_model_dir):
    """`fleetrl check` twice in fresh processes: the second reads the model checks back."""
    from launcher.prepare import ensure_data

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    ensure_data(_run_cfg(tmp_path, model))
    args = [
        "check", "--config", "configs/demo_cpu.yaml", f"model.path={model}",
        "model.create_tiny=false", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'test.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    probe = (
        "import sys; from launcher.cli import main; code = main(sys.argv[1:]); "
        "print('TORCH', 'torch' in sys.modules); sys.exit(code)"
    )
    env = {**os.environ, "FLEETRL_CACHE_DIR": str(memo)}
    seen = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        seen.append(done.stdout.split("TORCH ")[-1].strip())
    assert seen == ["True", "False"]
