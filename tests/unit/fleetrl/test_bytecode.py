"""fleetrl's modules compiled to byte-code where an editable install leaves them without."""

from __future__ import annotations

import importlib.util

from fleetrl.bytecode import PACKAGES, compile_packages


def test_modules_missing_byte_code_get_it_and_a_broken_one_is_reported(tmp_path, caplog):
    package = tmp_path / PACKAGES[0]
    (package / "sub").mkdir(parents=True)
    good = package / "sub" / "good.py"
    good.write_text("VALUE = 1\n")
    assert compile_packages(tmp_path)
    assert (tmp_path / importlib.util.cache_from_source(str(good))).exists()
    (package / "broken.py").write_text("def (:\n")
    assert not compile_packages(tmp_path)
    assert "did not compile" in caplog.text


def test_the_packages_are_the_ones_the_project_installs():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    installed = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert set(PACKAGES) == installed - {"bench"}  # the roles' code; bench runs in one process
