"""Static checks of docker/kubernetes (no cluster needed): every overlay renders with kustomize,
every object validates against the Kubernetes JSON schemas of kubernetes-validate (offline), and
the manifests agree with the server they run: ports, probe routes, ``LAPGUARD_*`` names and values,
the stop timings, the queue metric the autoscaler reads. The KServe InferenceService, whose CRD
has no schema here, is checked field by field (its pod part against the Pod schema)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from service.app import create_app
from service.metrics import Metrics
from service.server import stop_seconds
from service.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "docker" / "kubernetes"
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu"]
INFERENCE_SERVICE = KUBERNETES / "kserve" / "inferenceservice.yaml"
BUNDLE_DOCKERFILE = ROOT / "docker" / "Dockerfile.bundle"
#: The oldest Kubernetes release the manifests are validated for.
KUBERNETES_VERSION = "1.30"
#: Kustomize features the overlays use (``labels``, ``replicas``, ``patches``) need v5.
KUSTOMIZE_MAJOR = 5
#: Fields of a KServe predictor that are not a Kubernetes PodSpec's (ComponentExtensionSpec).
KSERVE_COMPONENT_FIELDS = {"minReplicas", "maxReplicas", "scaleTarget", "scaleMetric"}
PREFIX = "LAPGUARD_"


# ---- rendering ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.fail("kubectl is not installed: run `make system-tools` (it renders kustomize)")
    version = json.loads(
        subprocess.run(
            [binary, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    kustomize = version.get("kustomizeVersion", "v0")
    if int(kustomize.lstrip("v").split(".")[0]) < KUSTOMIZE_MAJOR:
        pytest.fail(
            f"kubectl {version['clientVersion']['gitVersion']} embeds kustomize {kustomize}; "
            f"the overlays need v{KUSTOMIZE_MAJOR} (kubectl 1.27 or later)"
        )
    return binary


@pytest.fixture(scope="module")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Each overlay's objects as `kubectl kustomize` renders them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for overlay in OVERLAYS:
        result = subprocess.run(
            [kubectl, "kustomize", str(KUBERNETES / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{overlay}: {result.stderr}"
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.fixture(params=OVERLAYS)
def objects(
    rendered: dict[str, list[dict[str, Any]]], request: pytest.FixtureRequest
) -> list[dict[str, Any]]:
    """One overlay's rendered objects: a test that takes them runs once per overlay."""
    return rendered[request.param]


@pytest.fixture(scope="module")
def inference_service() -> dict[str, Any]:
    return yaml.safe_load(INFERENCE_SERVICE.read_text())


@pytest.fixture(scope="module")
def app_paths() -> dict[str, str]:
    """The server's probe routes, by endpoint name, from the app itself."""
    app = create_app(Settings())
    return {name: app.url_path_for(name) for name in ("healthz", "readyz", "live", "ready")}


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def server_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod spec of the server's Deployment."""
    return find(objects, "Deployment", "lapguard")["spec"]["template"]["spec"]


def server_container(pod_spec: dict[str, Any], name: str = "lapguard") -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def settings_of(
    container: dict[str, Any], monkeypatch: pytest.MonkeyPatch, secret: dict[str, str]
) -> Settings:
    """The server's settings from the container's environment (the Secret's values for its
    references), read as `lapguard serve` reads them: a value it refuses fails here."""
    for name in [name for name in os.environ if name.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    for entry in container.get("env", []):
        if "value" in entry:
            monkeypatch.setenv(entry["name"], entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            monkeypatch.setenv(entry["name"], secret[ref["key"]])
    return load_settings()


def secret_values(objects: list[dict[str, Any]]) -> dict[str, str]:
    return find(objects, "Secret", "lapguard-keys")["stringData"]


def named_port(container: dict[str, Any], name: str) -> int:
    ports = [p["containerPort"] for p in container["ports"] if p.get("name") == name]
    assert len(ports) == 1, (name, container["ports"])
    return int(ports[0])


def prestop_sleep_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


# ---- schemas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Strict schemas: an unknown or misspelt field fails, as `kubectl apply` would refuse it."""
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert kinds == {
        "Deployment",
        "Service",
        "Secret",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            pytest.fail(
                f"{overlay}: {obj['kind']}/{obj['metadata']['name']} {path}: {error.message}"
            )


def test_the_inference_service_pod_validates_against_the_pod_schema(
    inference_service: dict[str, Any],
) -> None:
    """KServe's predictor is a PodSpec plus its scaling fields: the PodSpec part must be valid."""
    predictor = dict(inference_service["spec"]["predictor"])
    for field in KSERVE_COMPONENT_FIELDS:
        predictor.pop(field, None)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"}, "spec": predictor}
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


# ---- the server's settings ---------------------------------------------------------------------
def test_every_lapguard_variable_is_a_setting_the_server_accepts(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = server_container(server_pod(objects))
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), names
    _check_variable_names(names)
    settings = settings_of(container, monkeypatch, secret_values(objects))
    assert settings.host == "0.0.0.0"
    assert settings.query_memory == "redis"
    assert settings.api_key is not None


def test_the_inference_service_variables_are_settings(
    inference_service: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = server_container(inference_service["spec"]["predictor"], "kserve-container")
    _check_variable_names([e["name"] for e in container["env"]])
    settings = settings_of(container, monkeypatch, {"LAPGUARD_API_KEY": "placeholder"})
    assert settings.host == "0.0.0.0"


def _check_variable_names(names: list[str]) -> None:
    fields = set(Settings.model_fields)
    unknown = [n for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].lower() not in fields]
    # LAPGUARD_GRPC_PORT is declared ahead of the server reading it: the other names must exist.
    if "grpc_port" not in fields:
        unknown = [n for n in unknown if n != "LAPGUARD_GRPC_PORT"]
    assert not unknown, f"not settings of service/settings.py: {unknown}"


def test_ports_and_probes_match_the_server(
    objects: list[dict[str, Any]],
    app_paths: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deployment = find(objects, "Deployment", "lapguard")
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(pod)
    settings = settings_of(container, monkeypatch, secret_values(objects))
    env = literal_env(container)
    assert named_port(container, "http") == settings.port
    grpc = named_port(container, "grpc")
    assert int(env["LAPGUARD_GRPC_PORT"]) == grpc
    if "grpc_port" in Settings.model_fields:
        assert settings.grpc_port == grpc  # type: ignore[attr-defined]
    assert container["readinessProbe"]["httpGet"] == {"path": app_paths["readyz"], "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": app_paths["healthz"], "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": app_paths["healthz"], "port": "http"}

    service = find(objects, "Service", "lapguard")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"http", "grpc"}
    assert ports["http"]["targetPort"] == "http" and ports["grpc"]["targetPort"] == "grpc"
    template = deployment["spec"]["template"]["metadata"]
    assert template["annotations"]["prometheus.io/port"] == str(settings.port)


def test_the_grace_period_covers_the_prestop_and_the_servers_stop(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """preStop (the endpoints stop sending), then SIGTERM: the in-flight requests and the last
    batch (`service.server.stop_seconds`) must end before Kubernetes kills the pod."""
    pod = server_pod(objects)
    container = server_container(pod)
    settings = settings_of(container, monkeypatch, secret_values(objects))
    assert "LAPGUARD_GRACEFUL_TIMEOUT_S" in literal_env(container)  # stated, not a default
    sleep = prestop_sleep_s(container)
    assert sleep > 0
    assert pod["terminationGracePeriodSeconds"] >= sleep + stop_seconds(settings), (
        sleep,
        stop_seconds(settings),
    )


def test_the_inference_service_matches_the_server(
    inference_service: dict[str, Any], app_paths: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open Inference Protocol routes for its probes, the model named as the InferenceService
    (clients call /v2/models/<name>/infer), the bundle where KServe's storage initializer puts
    it, and a grace period that covers the stop."""
    assert inference_service["apiVersion"] == "serving.kserve.io/v1beta1"
    assert inference_service["kind"] == "InferenceService"
    name = inference_service["metadata"]["name"]
    predictor = inference_service["spec"]["predictor"]
    assert set(predictor) - KSERVE_COMPONENT_FIELDS <= {
        "containers",
        "securityContext",
        "terminationGracePeriodSeconds",
        "volumes",
    }
    assert predictor["minReplicas"] <= predictor["maxReplicas"]
    [container] = predictor["containers"]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    settings = settings_of(container, monkeypatch, {"LAPGUARD_API_KEY": "placeholder"})
    env = literal_env(container)
    assert settings.model_name == name
    assert str(settings.bundle) == "/mnt/models" and env["STORAGE_URI"]
    assert container["args"] == ["--bundle", str(settings.bundle)]
    assert named_port(container, "http") == settings.port
    assert container["readinessProbe"]["httpGet"] == {"path": app_paths["ready"], "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": app_paths["live"], "port": "http"}
    if predictor["maxReplicas"] > 1:
        assert settings.query_memory in ("redis", "off"), "replicas would not share query memory"
    grace = predictor["terminationGracePeriodSeconds"]
    assert grace >= prestop_sleep_s(container) + stop_seconds(settings)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


# ---- the pod: bundle, filesystem, user ---------------------------------------------------------
def dockerfile_user(path: Path) -> str:
    users = re.findall(r"^USER\s+(\S+)", path.read_text(), re.MULTILINE)
    return users[-1]


def test_the_pod_runs_unprivileged_on_a_read_only_root(objects: list[dict[str, Any]]) -> None:
    image_user = dockerfile_user(ROOT / "docker" / "Dockerfile").split(":")[0]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        if deployment["metadata"]["name"] == "lapguard":
            assert str(pod["securityContext"]["runAsUser"]) == image_user
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert {"requests", "limits"} <= set(container["resources"]), container["name"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert "emptyDir" in volumes[mount["name"]], mount  # writable paths are scratch


def test_the_bundle_is_copied_from_its_image_and_mounted_read_only(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = server_pod(objects)
    container = server_container(pod)
    settings = settings_of(container, monkeypatch, secret_values(objects))
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    bundle = mounts[str(settings.bundle)]
    assert bundle.get("readOnly") is True
    assert container["args"] == ["--bundle", str(settings.bundle)]
    assert "/tmp" in mounts  # multipart uploads are spooled there
    [init] = pod["initContainers"]
    assert init["image"].split(":")[0] == "lapguard-bundle"
    [target] = [m["mountPath"] for m in init["volumeMounts"] if m["name"] == bundle["name"]]
    copied_from = re.search(r"^COPY\s+\S+\s+(\S+)", BUNDLE_DOCKERFILE.read_text(), re.MULTILINE)
    assert copied_from is not None
    assert init["command"] == ["cp", "-R", f"{copied_from.group(1)}/.", f"{target}/"]


def test_the_bundle_image_runs_as_the_server_image_user() -> None:
    """Its USER is the server image's (tests/test_docker.py lints it with the other Dockerfiles)."""
    assert dockerfile_user(BUNDLE_DOCKERFILE) == dockerfile_user(ROOT / "docker" / "Dockerfile")


# ---- query memory, autoscaling, disruptions ----------------------------------------------------
def test_the_replicas_share_the_redis_of_the_manifests(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = server_pod(objects)
    settings = settings_of(server_container(pod), monkeypatch, secret_values(objects))
    url = urlsplit(settings.redis_url)
    service = find(objects, "Service", url.hostname or "")
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    redis = find(objects, "Deployment", url.hostname or "")
    assert redis["spec"]["replicas"] == 1  # one store, or replicas would miss each other's queries
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_autoscaler_reads_the_servers_queue_metric(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = find(objects, "Deployment", "lapguard")
    hpa = find(objects, "HorizontalPodAutoscaler", "lapguard")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "name": "lapguard",
    }
    assert hpa["minReplicas"] == deployment["spec"]["replicas"] <= hpa["maxReplicas"]
    [metric] = hpa["metrics"]
    assert metric["type"] == "Pods"
    queue = Metrics().queue_depth.describe()[0]
    assert queue.type == "gauge"
    assert metric["pods"]["metric"]["name"] == queue.name
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue"
    settings = settings_of(
        server_container(deployment["spec"]["template"]["spec"]),
        monkeypatch,
        secret_values(objects),
    )
    # a replica never queues more than max_queue: a higher target would never scale out
    assert 0 < float(target["averageValue"]) < settings.max_queue


def test_the_disruption_budget_covers_the_servers_only(objects: list[dict[str, Any]]) -> None:
    pdb = find(objects, "PodDisruptionBudget", "lapguard")["spec"]
    server = find(objects, "Deployment", "lapguard")["spec"]["template"]["metadata"]["labels"]
    redis = find(objects, "Deployment", "lapguard-redis")["spec"]["template"]["metadata"]["labels"]
    selector = pdb["selector"]["matchLabels"]
    assert selector.items() <= server.items()
    assert not selector.items() <= redis.items()
    assert pdb["maxUnavailable"] == 1


# ---- what each overlay changes -----------------------------------------------------------------
def test_the_cpu_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = server_pod(rendered["overlays/cpu"])
    container = server_container(pod)
    env = literal_env(container)
    assert container["image"] == "lapguard:cpu"
    assert env["LAPGUARD_DEVICE"] == "cpu"
    limits = container["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    # the container sees the node's cores, not its limit: threads stay under the limit
    assert int(env["LAPGUARD_TORCH_THREADS"]) < float(limits["cpu"])
    assert "nodeSelector" not in pod


def test_the_gpu_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = server_pod(rendered["overlays/gpu"])
    container = server_container(pod)
    env = literal_env(container)
    assert container["image"] == "lapguard:gpu"
    assert env["LAPGUARD_DEVICE"].startswith("cuda")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env["CUDA_CACHE_PATH"].startswith("/tmp/")  # the only writable path
