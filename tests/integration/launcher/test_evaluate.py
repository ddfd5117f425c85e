"""Policy snapshots (learner/snapshot.py) and ``fleetrl eval`` (launcher/evaluate.py).

A snapshot must be a Hugging Face folder that holds exactly the weights it was
given; ``fleetrl eval`` must score a folder the way in-run validation does
(greedy, the run's prompts and rewards), so identical weights score identically,
and must refuse bad input before serving anything.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from fleetrl.data.schema import write_rows
from fleetrl.data.synth import get_task, make_rows
from launcher.cli import UsageError
from launcher.config import load_run_config
from launcher.evaluate import evaluate
from launcher.evaluate import main as eval_main
from learner.snapshot import WEIGHTS_FILE, snapshot_steps, write_hf_snapshot
from weight_sync.engine_client import EngineCallError

VAL_ROWS = 12


def _policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _cfg(tmp_path, model_dir):
    val = write_rows(make_rows(get_task("add"), "test", VAL_ROWS, seed=0), tmp_path / "val.parquet")
    return load_run_config(
        None,
        [
            f"model.path={model_dir}",
            "model.create_tiny=false",
            f"data.val_files=[{val}]",
            "data.synth_task=''",
            "rollout.max_new_tokens=8",
            "trainer.device=cpu",
        ],
    )


def test_snapshot_holds_the_weights_given_and_loads_as_a_hugging_face_model(
    tiny_model_dir, tmp_path
):
    model = _policy(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # not the weights on disk
    named = list(model.state_dict().items())
    path = write_hf_snapshot(
        iter(named), model_path=tiny_model_dir, root=tmp_path / "snaps", step=3, rank=0
    )
    assert path == tmp_path / "snaps" / "step_3" and not (tmp_path / "snaps/step_3.tmp").exists()
    assert {"config.json", WEIGHTS_FILE, "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    reloaded = _policy(path)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, dict(named)[name], rtol=0, atol=0, msg=name)
    assert snapshot_steps(tmp_path / "snaps") == [(3, path)]


def test_other_ranks_consume_the_stream_and_write_nothing(tiny_model_dir, tmp_path):
    consumed = []

    def stream():
        for name, tensor in _policy(tiny_model_dir).state_dict().items():
            consumed.append(name)
            yield name, tensor

    write_hf_snapshot(stream(), model_path=tiny_model_dir, root=tmp_path, step=1, rank=1)
    assert consumed and not (tmp_path / "step_1").exists()


def test_snapshot_without_the_model_folder_config_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        write_hf_snapshot(iter(()), model_path=tmp_path / "nowhere", root=tmp_path, step=0, rank=0)


def test_unfinished_snapshots_are_not_listed(tmp_path):
    (tmp_path / "step_2.tmp").mkdir()
    (tmp_path / "step_4").mkdir()  # no weights file: not complete
    (tmp_path / "step_6").mkdir()
    (tmp_path / "step_6" / WEIGHTS_FILE).write_bytes(b"x")
    assert [step for step, _ in snapshot_steps(tmp_path)] == [6]


def test_eval_scores_identical_weights_identically_and_every_prompt_once(tiny_model_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_model_dir)
    copy = tmp_path / "copy"
    write_hf_snapshot(
        iter(_policy(tiny_model_dir).state_dict().items()),
        model_path=tiny_model_dir,
        root=tmp_path,
        step=0,
        rank=0,
    )
    shutil.move(tmp_path / "step_0", copy)
    first, second = evaluate(cfg, [tiny_model_dir, copy])
    assert first["val/num_samples"] == VAL_ROWS and first["val/num_failed"] == 0
    assert 0.0 <= first["val/score/mean"] <= 1.0
    assert {k: v for k, v in first.items() if k != "model"} == {
        k: v for k, v in second.items() if k != "model"
    }


def test_eval_refuses_a_config_without_held_out_files_or_a_folder_without_a_model(
    tiny_model_dir, tmp_path
):
    cfg = _cfg(tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match="no Hugging Face model"):
        list(evaluate(cfg, [tmp_path]))
    no_val = load_run_config(None, [f"model.path={tiny_model_dir}", "data.val_files=[]"])
    with pytest.raises(ValueError, match="data.val_files is empty"):
        list(evaluate(no_val, [tiny_model_dir]))


def test_eval_cli_scores_a_runs_snapshots_by_step_and_refuses_a_run_without_any(
    tiny_model_dir, tmp_path, capsys
):
    cfg = _cfg(tmp_path, tiny_model_dir)
    (tmp_path / "run.yaml").write_text(json.dumps({"data": {"val_files": cfg.data.val_files}}))
    overrides = [f"model.path={tiny_model_dir}", "rollout.max_new_tokens=8", "trainer.device=cpu"]
    args = argparse.Namespace(
        config=str(tmp_path / "run.yaml"),
        overrides=overrides,
        model=[],
        snapshots=str(tmp_path),
        engine_url="",
        api_key=None,
    )
    with pytest.raises(UsageError, match="no policy snapshots"):
        eval_main(args)
    state = _policy(tiny_model_dir).state_dict()
    for step in (4, 2):
        write_hf_snapshot(
            iter(state.items()),
            model_path=tiny_model_dir,
            root=tmp_path / "hf_snapshots",
            step=step,
            rank=0,
        )
    assert eval_main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["model"].rsplit("/", 1)[-1] for line in lines] == ["step_2", "step_4"]
    assert lines[0]["val/score/mean"] == lines[1]["val/score/mean"]


def _snapshot_of(model, tiny_model_dir, tmp_path, name):
    write_hf_snapshot(
        iter(model.state_dict().items()), model_path=tiny_model_dir, root=tmp_path, step=0, rank=0
    )
    return shutil.move(tmp_path / "step_0", tmp_path / name)


def _ends_at_once(tiny_model_dir, tmp_path):
    """A snapshot whose greedy answer is end-of-sequence at once: the last layer's attention
    adds a large constant (v_proj weights 0, bias 1, o_proj one column), and the LM head
    maps that constant's direction to the EOS token."""
    from fleetrl.models.loading import load_tokenizer

    model = _policy(tiny_model_dir)
    attn = model.model.layers[-1].self_attn
    with torch.no_grad():
        attn.v_proj.weight.zero_()
        attn.v_proj.bias.fill_(1.0)
        attn.o_proj.weight.zero_()
        attn.o_proj.weight[:, 0] = 1000.0
        model.lm_head.weight[load_tokenizer(str(tiny_model_dir)).eos_token_id] = 100.0
    return _snapshot_of(model, tiny_model_dir, tmp_path, "changed")


def test_one_engine_scores_each_folder_with_that_folders_weights(tiny_model_dir, tmp_path):
    """Folders after the first are loaded in place (/update_weights_from_disk): a different
    policy scores differently, and going back to the first gives its score again."""
    cfg = _cfg(tmp_path, tiny_model_dir)
    changed = _ends_at_once(tiny_model_dir, tmp_path)
    first, second, third = (
        {k: v for k, v in r.items() if k != "model"}
        for r in evaluate(cfg, [tiny_model_dir, changed, tiny_model_dir])
    )
    assert second["val/response_length/mean"] == 1.0 != first["val/response_length/mean"]
    assert third == first


def test_eval_on_a_running_server_loads_every_folder_there(tiny_model_dir, tmp_path):
    from rollout_fleet.engine.server import EmbeddedEngine

    cfg = _cfg(tmp_path, tiny_model_dir)
    changed = _ends_at_once(tiny_model_dir, tmp_path)
    local = [{k: v for k, v in r.items() if k != "model"} for r in evaluate(cfg, [tiny_model_dir])]
    # the server starts on the changed weights: the first folder must be loaded there too
    server = EmbeddedEngine(str(changed), engine_id="remote", api_key="k3y")
    url = server.start_server()
    try:
        with pytest.raises(EngineCallError, match="HTTP 401"):
            list(evaluate(cfg, [tiny_model_dir], engine_url=url))
        remote = [
            {k: v for k, v in r.items() if k != "model"}
            for r in evaluate(cfg, [tiny_model_dir], engine_url=url, api_key="k3y")
        ]
    finally:
        server.stop()
    assert remote == local


def test_eval_refuses_folders_whose_tokenizers_differ(tiny_model_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_model_dir)
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    tokenizer_file = next(other.glob("tokenizer*"))
    tokenizer_file.write_bytes(tokenizer_file.read_bytes() + b" ")
    with pytest.raises(ValueError, match="tokenizer of .*other differs"):
        list(evaluate(cfg, [tiny_model_dir, other]))
