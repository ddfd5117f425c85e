"""Offline validation of the cluster configs in configs/cluster/.

aws.yaml goes through what `ray up` itself runs before touching the cloud: the JSON
schema Ray ships (ray/autoscaler/ray-schema.json), then ``prepare_config`` (merge with
the AWS defaults) and ``validate_config``. kuberay.yaml goes through the translation
Ray's in-tree KubeRay autoscaler applies to a RayCluster CR
(``_derive_autoscaling_config_from_ray_cr``, which ends in ``validate_config``), which also
proves the ``rayStartParams.resources`` quoting parses as Ray expects. Neither needs
network access or cloud credentials.

Left out: the KubeRay CRD's OpenAPI schema (not shipped with Ray, ~700 KB upstream,
mostly the Kubernetes pod template); the structure tests below cover what fleetrl relies
on instead.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from launcher.config import RayConfig

REPO_ROOT = Path(__file__).resolve().parents[3]
AWS_YAML = REPO_ROOT / "configs" / "cluster" / "aws.yaml"
KUBERAY_YAML = REPO_ROOT / "configs" / "cluster" / "kuberay.yaml"

ROLLOUT = RayConfig().rollout_resource
LEARNER = RayConfig().learner_resource
REWARD = RayConfig().reward_resource
# node type / worker group name -> the custom resource that marks it
AWS_WORKER_TYPES = {"rollout_gpu": ROLLOUT, "learner_gpu": LEARNER, "reward_gpu": REWARD}
KUBERAY_GROUPS = {"rollout": ROLLOUT, "learner": LEARNER, "reward": REWARD}
RAY_PIN = re.compile(r"ray\[default\]==([0-9][0-9.]*)")
TORCH_PIN = re.compile(r"torch==([0-9][0-9.]*)")
WHEEL_ON_NODE = "$HOME/fleetrl/dist/fleetrl-*.whl"  # where file_mounts puts `make wheel`'s dist/


def _load_aws() -> dict[str, Any]:
    return yaml.safe_load(AWS_YAML.read_text())


def _load_kuberay() -> dict[str, Any]:
    return yaml.safe_load(KUBERAY_YAML.read_text())


def _ray_schema() -> dict[str, Any]:
    import ray.autoscaler

    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return json.loads(schema_path.read_text())


def _ray_up_validate(config: dict[str, Any]) -> dict[str, Any]:
    """The checks `ray up` runs before any cloud call; returns the prepared config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    jsonschema.validate(config, _ray_schema())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _derive_kuberay_autoscaling_config(ray_cr: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = copy.deepcopy(ray_cr)
    # the operator hands the autoscaler the stored object, which always has a namespace
    cr["metadata"].setdefault("namespace", "fleetrl")
    return _derive_autoscaling_config_from_ray_cr(cr)


def _worker_group(ray_cr: dict[str, Any], name: str) -> dict[str, Any]:
    groups = {g["groupName"]: g for g in ray_cr["spec"]["workerGroupSpecs"]}
    assert name in groups, f"kuberay.yaml has no workerGroupSpec named {name!r}"
    return groups[name]


def _kuberay_custom_resources(group: dict[str, Any]) -> dict[str, Any]:
    """Decode rayStartParams.resources ('"{\\"rollout\\": 8}"') the way KubeRay's autoscaler does."""
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), f"not KubeRay-quoted: {raw!r}"
    return json.loads(raw[1:-1].replace("\\", ""))


# --- aws.yaml -------------------------------------------------------------------------


def test_aws_config_passes_ray_up_validation_offline():
    prepared = _ray_up_validate(_load_aws())
    assert prepared["head_node_type"] == "head"
    assert set(prepared["available_node_types"]) == {"head", *AWS_WORKER_TYPES}


def test_ray_up_validation_rejects_fractional_custom_resource():
    # negative control: the validator used above is live and checks node-type resources
    config = _load_aws()
    config["available_node_types"]["rollout_gpu"]["resources"][ROLLOUT] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        _ray_up_validate(config)


def test_ray_up_validation_rejects_max_workers_below_sum_of_min_workers():
    config = _load_aws()
    config["max_workers"] = 1  # rollout_gpu and learner_gpu each keep one node warm
    with pytest.raises(ValueError, match="max_workers"):
        _ray_up_validate(config)


def test_aws_worker_types_carry_distinct_custom_resources():
    node_types = _load_aws()["available_node_types"]
    for name, resource in AWS_WORKER_TYPES.items():
        others = set(AWS_WORKER_TYPES.values()) - {resource}
        resources = node_types[name]["resources"]
        assert resources.get(resource, 0) >= 1, f"{name} lacks custom resource {resource!r}"
        assert not others & set(resources), f"{name} also carries {others & set(resources)}"


def test_aws_custom_resource_has_one_unit_per_gpu():
    node_types = _load_aws()["available_node_types"]
    for name, resource in AWS_WORKER_TYPES.items():
        resources = node_types[name]["resources"]
        assert resources.get("GPU", 0) >= 1, f"{name} declares no GPU"
        assert resources[resource] == resources["GPU"], f"{name}: {resources}"


def test_aws_head_gets_no_gpu_and_no_rl_resource():
    head = _load_aws()["available_node_types"]["head"]
    assert head.get("min_workers", 0) == 0 and head.get("max_workers", 0) == 0
    assert not {"GPU", ROLLOUT, LEARNER, REWARD} & set(head["resources"])


def test_aws_rollout_learner_and_reward_scale_separately_within_global_cap():
    config = _load_aws()
    node_types = config["available_node_types"]
    for name in AWS_WORKER_TYPES:
        node = node_types[name]
        assert "min_workers" in node and "max_workers" in node, f"{name} lacks its own bounds"
        assert 0 <= node["min_workers"] <= node["max_workers"], f"{name}: min > max"
    # each side can reach its own max_workers while the other is at its max too
    assert config["max_workers"] >= sum(node_types[n]["max_workers"] for n in AWS_WORKER_TYPES)


def test_aws_each_worker_type_setup_is_complete_and_installs_its_extra():
    # a node type's worker_setup_commands replace the global lists for that type
    config = _load_aws()
    common = config["setup_commands"]
    node_types = config["available_node_types"]
    for name in AWS_WORKER_TYPES:
        commands = node_types[name]["worker_setup_commands"]
        assert commands[: len(common)] == common, f"{name} skips the common setup steps"
    rollout_install = " ".join(node_types["rollout_gpu"]["worker_setup_commands"])
    learner_install = " ".join(node_types["learner_gpu"]["worker_setup_commands"])
    reward_install = " ".join(node_types["reward_gpu"]["worker_setup_commands"])
    assert f'"$(echo {WHEEL_ON_NODE})[sglang]"' in rollout_install
    assert f'"$(echo {WHEEL_ON_NODE})[sglang]"' in reward_install  # SGLang --is-embedding
    assert learner_install.endswith(f" {WHEEL_ON_NODE}") and "sglang" not in learner_install
    assert "boto3" in " ".join(config["head_setup_commands"]), "the head autoscaler needs boto3"


def _install_lists(config: dict[str, Any]) -> dict[str, list[str]]:
    lists = {"head": config["setup_commands"] + config["head_setup_commands"]}
    for name in AWS_WORKER_TYPES:
        lists[name] = config["available_node_types"][name]["worker_setup_commands"]
    return lists


def _published_names() -> set[str]:
    """pyproject's dependencies and extras, by name: what a node may install besides the
    project's own wheel (plus boto3, which Ray's AWS autoscaler on the head needs)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [
        spec for extra in project["optional-dependencies"].values() for spec in extra
    ]
    return {Requirement(spec).name for spec in specs} | {"boto3"}


def test_configs_install_only_this_projects_wheel_and_published_dependencies():
    from packaging.requirements import Requirement

    allowed = _published_names()
    for node_type, commands in _install_lists(_load_aws()).items():
        installs = [c for c in commands if " pip install " in c]
        assert len(installs) == 1, f"{node_type}: {installs}"
        args = shlex.split(installs[0].split(" pip install ", 1)[1])
        specs = args[2:]  # after --python PATH
        assert args[0] == "--python", installs[0]
        wheels = [s for s in specs if WHEEL_ON_NODE.split("/")[-1] in s]
        assert len(wheels) == 1, f"{node_type} does not install the wheel from file_mounts"
        for spec in specs:
            if spec in wheels:
                continue
            name = Requirement(spec).name
            assert name != "fleetrl", f"{node_type}: {spec!r} would come from a package index"
            assert name in allowed, f"{node_type}: {spec!r} is not a published dependency"
    # every file under configs/ that names a container image names this project's
    for path in (REPO_ROOT / "configs").rglob("*.yaml"):
        for image in re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.MULTILINE):
            assert image == f"REGISTRY/fleetrl:{_version()}", f"{path}: image {image}"


def test_aws_ships_the_wheel_that_make_wheel_builds_to_where_setup_installs_it():
    mounts = _load_aws()["file_mounts"]
    assert mounts["/home/ubuntu/fleetrl/dist"] == "./dist"
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "--wheel-dir dist ." in makefile  # `make wheel` writes dist/ and nothing else there


def _version() -> str:
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_aws_every_install_pins_the_same_ray_and_torch_as_the_makefile():
    makefile = (REPO_ROOT / "Makefile").read_text()
    for pattern in (RAY_PIN, TORCH_PIN):
        (make_pin,) = set(pattern.findall(makefile))  # TORCH / RAY: the venv's and the image's
        for name, commands in _install_lists(_load_aws()).items():
            assert pattern.findall(" ".join(commands)) == [make_pin], (name, pattern.pattern)


def test_aws_start_commands_leave_custom_resources_to_node_types():
    config = _load_aws()
    worker_start = " ".join(config["worker_start_ray_commands"])
    head_start = " ".join(config["head_start_ray_commands"])
    # one command serves every worker type: a --resources flag would mark all of them alike
    assert "--resources" not in worker_start
    assert "--address=$RAY_HEAD_IP:6379" in worker_start
    assert "--dashboard-host=127.0.0.1" in head_start


def test_aws_file_mount_sources_exist_in_repo():
    for local in _load_aws().get("file_mounts", {}).values():
        if local != "./dist":  # made by `make wheel`
            assert (REPO_ROOT / local).exists(), f"file_mounts source {local!r} missing"


# --- kuberay.yaml ---------------------------------------------------------------------


def test_kuberay_is_an_autoscaling_v1_raycluster():
    ray_cr = _load_kuberay()
    assert ray_cr["apiVersion"] == "ray.io/v1"
    assert ray_cr["kind"] == "RayCluster"
    assert ray_cr["spec"]["enableInTreeAutoscaling"] is True
    assert ray_cr["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    names = [g["groupName"] for g in ray_cr["spec"]["workerGroupSpecs"]]
    assert sorted(names) == sorted(KUBERAY_GROUPS)


def test_kuberay_translates_through_rays_autoscaler_with_custom_resources():
    derived = _derive_kuberay_autoscaling_config(_load_kuberay())
    node_types = derived["available_node_types"]
    for name, resource in KUBERAY_GROUPS.items():
        resources = node_types[name]["resources"]
        assert resources[resource] == resources["GPU"] >= 1, f"{name}: {resources}"
        assert not (set(KUBERAY_GROUPS.values()) - {resource}) & set(resources)
    head = node_types["headgroup"]["resources"]
    assert not {"GPU", ROLLOUT, LEARNER, REWARD} & set(head)


def test_kuberay_rejects_unquoted_resources_like_ray_does():
    # negative control: without KubeRay's outer quotes Ray's parser drops the first and
    # last characters and fails, so the quoting in kuberay.yaml is load-bearing
    ray_cr = _load_kuberay()
    _worker_group(ray_cr, "rollout")["rayStartParams"]["resources"] = json.dumps({ROLLOUT: 8})
    with pytest.raises(json.JSONDecodeError):
        _derive_kuberay_autoscaling_config(ray_cr)


def test_kuberay_worker_groups_have_bounds_gpus_and_their_resource():
    ray_cr = _load_kuberay()
    for name, resource in KUBERAY_GROUPS.items():
        group = _worker_group(ray_cr, name)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        container = group["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        requests = container["resources"]["requests"]
        # Kubernetes requires extended resources' request == limit
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus == int(requests["nvidia.com/gpu"]) >= 1, name
        assert _kuberay_custom_resources(group) == {resource: gpus}  # one unit per GPU


def test_kuberay_pins_the_same_ray_version_as_aws():
    aws_pin = RAY_PIN.findall(" ".join(_load_aws()["head_setup_commands"]))[0]
    assert _load_kuberay()["spec"]["rayVersion"] == aws_pin


def test_reward_nodes_scale_from_zero_and_only_for_reward_servers():
    aws = _load_aws()["available_node_types"]["reward_gpu"]
    assert aws["min_workers"] == 0 and aws["max_workers"] >= 1
    group = _worker_group(_load_kuberay(), "reward")
    assert group["minReplicas"] == group["replicas"] == 0 and group["maxReplicas"] >= 1
    derived = _derive_kuberay_autoscaling_config(_load_kuberay())["available_node_types"]
    assert derived["reward"]["min_workers"] == 0  # the autoscaler may start it from nothing
    assert derived["reward"]["resources"][REWARD] == derived["reward"]["resources"]["GPU"]
