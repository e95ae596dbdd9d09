"""The launch recipes of examples/launch, checked as far as a machine without a cluster can: each
YAML file parses; each recipe's torchrun command line (read from the recipe, with sample values
for the variables the scheduler sets) parses with torchrun's own argument parser and runs
`fastllm train`, whose arguments parse with the current command line's parser and whose config
validates with the overrides given; the rendezvous settings agree with the rest of the recipe;
the Dockerfile installs with the script the wheel test runs."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.run import get_args_parser

from fastllm import cli
from tests import test_install
from tests.conftest import ROOT
from tests.data.conftest import run_cli

LAUNCH = ROOT / "examples" / "launch"
IMAGE_ROOT = "/opt/fastllm/"
"""Where the Dockerfile copies the repository's examples/ (as IMAGE_ROOT/examples)."""

SAMPLE_ENVIRONMENT = {
    # Slurm, for a 4-node job of 8 GPUs each (examples/launch/slurm.sbatch's #SBATCH lines)
    "SLURM_NNODES": "4",
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_JOB_ID": "4242",
    "HEAD_NODE": "node001",
    "which fastllm": "/shared/venv/bin/fastllm",
    # Kubeflow's training operator, for a pod of a 4-pod PyTorchJob
    "WORLD_SIZE": "4",
    "RANK": "1",
    "MASTER_ADDR": "fastllm-llama3-8b-master-0",
    "MASTER_PORT": "23456",
}
VARIABLE = re.compile(r"\$\(([^)]+)\)|\$\{(\w+)\}|\$(\w+)")


def expand(text: str, environment: dict[str, str]) -> str:
    """$NAME, ${NAME} (shell), $(NAME) (Kubernetes, and the shell's $(which fastllm)) replaced
    by their sample values; an unknown name fails the test."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        assert name in environment, f"no sample value for ${name} in {text!r}"
        return environment[name]

    return VARIABLE.sub(value, text)


def slurm_command() -> list[str]:
    """The torchrun command line of slurm.sbatch, run as its usage line (in its header) says."""
    script = (LAUNCH / "slurm.sbatch").read_text()
    usage = re.search(r"^#\s+sbatch (\S+) (.*)$", script, re.M)
    assert usage is not None and usage.group(1) == "examples/launch/slurm.sbatch"
    config, *overrides = shlex.split(usage.group(2))
    command = re.search(r"^srun [^\n]*?torchrun (.*?[^\\])$", script, re.M | re.S)
    assert command is not None, "no srun ... torchrun line"
    text = command.group(1).replace("\\\n", " ").replace('"$@"', shlex.join(overrides))
    return shlex.split(expand(text, SAMPLE_ENVIRONMENT | {"CONFIG": config}))


def manifests(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((LAUNCH / name).read_text()))


def containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    if manifest["kind"] == "PyTorchJob":
        specs = manifest["spec"]["pytorchReplicaSpecs"].values()
        return [c for spec in specs for c in spec["template"]["spec"]["containers"]]
    return manifest["spec"]["template"]["spec"]["containers"]


def container_command(container: dict[str, Any]) -> list[str]:
    command = [expand(word, SAMPLE_ENVIRONMENT) for word in container["command"]]
    assert command[0] == "torchrun", command
    return command[1:]


def recipe_commands() -> dict[str, list[str]]:
    """Every recipe's torchrun arguments, by recipe."""
    commands = {"slurm.sbatch": slurm_command()}
    for name in ("pytorchjob.yaml", "indexed-job.yaml"):
        for index, container in enumerate(workload_containers(name)):
            commands[f"{name}:{index}"] = container_command(container)
    return commands


def workload_containers(name: str) -> list[dict[str, Any]]:
    """The containers of a manifest file's PyTorchJob or Job (not its Service)."""
    return [c for m in manifests(name) if m["kind"] != "Service" for c in containers(m)]


def torchrun_arguments(arguments: list[str]) -> argparse.Namespace:
    return get_args_parser().parse_args(arguments)


def fastllm_arguments(torchrun: argparse.Namespace) -> list[str]:
    """The `fastllm` arguments torchrun passes on: to `-m fastllm.cli` or to the fastllm script."""
    if torchrun.module:
        assert torchrun.training_script == "fastllm.cli"
    else:
        assert Path(torchrun.training_script).name == "fastllm" and not torchrun.no_python
    return torchrun.training_script_args


def test_every_yaml_recipe_parses() -> None:
    names = sorted(p.name for p in LAUNCH.glob("*.yaml"))
    assert names == ["indexed-job.yaml", "pytorchjob.yaml"]
    for name in names:
        assert all(isinstance(m, dict) and "kind" in m for m in manifests(name)), name


RECIPES = ["indexed-job.yaml:0", "pytorchjob.yaml:0", "pytorchjob.yaml:1", "slurm.sbatch"]
"""Each torchrun command line: the Slurm script's, the PyTorchJob's Master and Worker, the Job's."""


def test_recipes_are_slurm_kubeflow_and_an_indexed_job() -> None:
    assert sorted(recipe_commands()) == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_fastllm_train_with_a_config_that_validates(recipe: str) -> None:
    arguments = fastllm_arguments(torchrun_arguments(recipe_commands()[recipe]))
    args, strays = cli.build_parser().parse_known_args(arguments)
    assert args.command == "train" and args.handler is cli._train
    assert not any(stray.startswith("-") for stray in strays), strays
    _, overrides = cli._split_family(args.arguments + strays)
    assert any(o.startswith("data.path=") for o in overrides), "no dataset on shared storage"
    assert any(o.startswith("run.experiment_dir=") for o in overrides), "no experiment dir"
    configs = [
        str(ROOT / c[len(IMAGE_ROOT) :]) if c.startswith(IMAGE_ROOT) else str(ROOT / c)
        for c in args.config
    ]
    assert configs and all(Path(c).is_file() for c in configs), configs
    options = [word for config in configs for word in ("-c", config)]
    result = run_cli("config", "validate", *options, *overrides)
    assert result.returncode == 0, result.stderr


def test_slurm_rendezvous_is_c10d_on_the_first_node_one_rank_per_gpu() -> None:
    torchrun = torchrun_arguments(slurm_command())
    assert torchrun.rdzv_backend == "c10d"
    assert torchrun.rdzv_endpoint == f"{SAMPLE_ENVIRONMENT['HEAD_NODE']}:29500"
    assert torchrun.rdzv_id == SAMPLE_ENVIRONMENT["SLURM_JOB_ID"]
    script = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1\n" in script  # one torchrun per node
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M)
    gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)$", script, re.M)
    assert nodes and gpus
    assert torchrun.nnodes == SAMPLE_ENVIRONMENT["SLURM_NNODES"] == nodes.group(1)
    assert torchrun.nproc_per_node == SAMPLE_ENVIRONMENT["SLURM_GPUS_PER_NODE"] == gpus.group(1)


def gpu_limit(container: dict[str, Any]) -> str:
    return str(container["resources"]["limits"]["nvidia.com/gpu"])


def test_pytorchjob_uses_the_operators_master_and_ranks() -> None:
    (job,) = manifests("pytorchjob.yaml")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container the operator configures
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
        torchrun = torchrun_arguments(container_command(container))
        assert torchrun.rdzv_backend == "static"
        assert "--nnodes=$(WORLD_SIZE)" in container["command"]
        assert "--node-rank=$(RANK)" in container["command"]
        assert "--master-addr=$(MASTER_ADDR)" in container["command"]
        assert "--master-port=$(MASTER_PORT)" in container["command"]
        assert torchrun.nproc_per_node == gpu_limit(container)
        assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}


def test_indexed_job_rendezvous_names_pod_0_through_the_headless_service() -> None:
    service, job = manifests("indexed-job.yaml")
    assert service["kind"] == "Service" and job["kind"] == "Job"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    (container,) = spec["template"]["spec"]["containers"]
    torchrun = torchrun_arguments(container_command(container))
    assert torchrun.rdzv_backend == "c10d"
    host, port = torchrun.rdzv_endpoint.split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert torchrun.nnodes == str(spec["completions"]) == str(spec["parallelism"])
    assert torchrun.nproc_per_node == gpu_limit(container)
    assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}


def test_dockerfile_installs_with_the_wheel_tests_script_and_copies_the_examples() -> None:
    dockerfile = (LAUNCH / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.replace("\\\n", " ").splitlines()]
    copy = next(line for line in lines if line.startswith("COPY examples/launch/install"))
    script = test_install.INSTALL_SCRIPT.relative_to(ROOT)
    source, *wheels, target = copy.split()[1:]
    assert source == str(script)
    assert wheels == ["dist/fastllm-*.whl", "dist/fastllm_kernels-*.whl"]
    assert (
        f"RUN sh {target}{script.name} {target.rstrip('/')} && rm -rf {target.rstrip('/')}" in lines
    )
    assert f"COPY examples {IMAGE_ROOT}examples" in lines
    assert 'ENTRYPOINT ["torchrun"]' in lines
    manifest_files = ("pytorchjob.yaml", "indexed-job.yaml")
    images = {c["image"] for name in manifest_files for c in workload_containers(name)}
    assert len(images) == 1  # both manifests run the one image the Dockerfile builds
