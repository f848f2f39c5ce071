"""Operations routes and cross-cutting behaviour on a live server: model summary, health and
readiness, request ids, Prometheus metrics."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from detector.guard import Guard
from service import healthcheck
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import ADMIN_KEY, CLASSES, STRICT_TARGET_FPR, v2_request
from tests.test_docker import DOCKERFILES, ROOT, exec_form, final_stage, instructions


def test_model_summary_and_health(client, guard) -> None:
    summary = client.get("/v1/model").json()
    assert summary["name"] == "tiny" and summary["version"] == "7"
    assert summary["class_names"] == CLASSES
    assert summary["threshold"] == pytest.approx(guard.threshold)
    assert summary["target_fpr"] == pytest.approx(0.1)
    assert summary["input_spec"]["height"] == 28 and summary["ready"] is True
    assert client.get("/healthz").json() == {"status": "ok", "ready": True}
    assert client.get("/readyz").status_code == 200


def test_a_server_at_another_operating_point_flags_at_its_threshold(
    service_bundle, guard, images
) -> None:
    """`target_fpr` serves one of the bundle's operating points: /v1/model says which, with the
    others, and the answers flag at its threshold (the scores are the bundle's own); a reload
    keeps the point."""
    settings = Settings(
        bundle=service_bundle, device="cpu", target_fpr=STRICT_TARGET_FPR, admin_key=ADMIN_KEY
    )
    strict = Guard.from_bundle(service_bundle, device="cpu", target_fpr=STRICT_TARGET_FPR)
    assert strict.threshold != guard.threshold
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        summary = client.get("/v1/model").json()
        assert summary["threshold"] == strict.threshold
        assert summary["target_fpr"] == STRICT_TARGET_FPR
        assert {p["target_fpr"] for p in summary["operating_points"]} == {0.1, STRICT_TARGET_FPR}
        files = [("files", (f"{i}.png", blob, "image/png")) for i, blob in enumerate(images[:5])]
        for _ in range(2):  # before and after a reload of the same directory
            results = client.post("/v1/predict", files=files).json()["results"]
            assert all(r["threshold"] == strict.threshold for r in results)
            assert all(r["flagged"] == (r["score"] > strict.threshold) for r in results)
            reload = client.post("/v1/admin/reload", headers={"X-API-Key": ADMIN_KEY})
            assert reload.status_code == 200, reload.text


def test_request_id_is_echoed_or_generated(client) -> None:
    assert (
        client.get("/healthz", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"]
        == "abc-123"
    )
    generated = client.get("/healthz").headers["x-request-id"]
    assert len(generated) == 32


def test_not_ready_or_draining_answers_503_with_retry_after(client, server, images) -> None:
    server.runtime.draining = True
    try:
        for response in (
            client.get("/readyz"),
            client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}),
        ):
            assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
            assert int(response.headers["retry-after"]) >= 1
        assert client.get("/healthz").json()["status"] == "draining"
    finally:
        server.runtime.draining = False
    assert client.get("/readyz").status_code == 200


def test_metrics_are_exposed(client, images) -> None:
    client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
    assert (
        client.post("/v2/models/tiny/infer", **v2_request([1, 1, 28, 28], 784)).status_code == 200
    )
    text = client.get("/metrics").text
    assert 'lapguard_http_requests_total{method="POST",route="/v1/predict",status="200"}' in text
    assert (
        'lapguard_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/predict",status="200"}'
        in text
    )
    assert 'route="/v2/models/{name}/infer"' in text
    for name in (
        "lapguard_batch_size_bucket",
        "lapguard_queue_wait_seconds_bucket",
        "lapguard_score_bucket",
        "lapguard_images_total",
        "lapguard_flagged_total",
        "lapguard_ready 1.0",
    ):
        assert name in text


def test_container_healthcheck_probes_the_port_of_the_settings(server, monkeypatch) -> None:
    monkeypatch.setenv("LAPGUARD_PORT", str(server.port))
    assert healthcheck.main(["/readyz"]) == 0 and healthcheck.main([]) == 0
    assert healthcheck.main(["/nowhere"]) == 1
    assert healthcheck.check("/healthz", port=server.port)
    server.runtime.draining = True
    try:
        assert healthcheck.main(["/readyz"]) == 1
    finally:
        server.runtime.draining = False


# ---- the container health check, as the engine runs it -------------------------------------------
def _image_environment(dockerfile: Path, tmp: Path) -> dict[str, str]:
    """The LAPGUARD_* variables of ``dockerfile``'s ENV, its /tmp moved under ``tmp``: what the
    engine gives the server and, separately, every health check process."""
    env = " ".join(rest for keyword, rest in instructions(dockerfile) if keyword == "ENV")
    pairs = dict(word.split("=", 1) for word in shlex.split(env))
    image = {
        k: v.replace("/tmp/", f"{tmp}/") for k, v in pairs.items() if k.startswith("LAPGUARD_")
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LAPGUARD_")}
    return {**clean, **image}


@pytest.mark.slow
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_container_healthcheck_probes_the_port_the_server_was_started_with(
    service_bundle: Path, dockerfile: Path, tmp_path: Path
) -> None:
    """`lapguard serve --port P` under the image's environment, whose LAPGUARD_PORT is a port
    nobody listens on; the image's HEALTHCHECK command, run in a process of its own with that
    environment, finds the server on P, and no longer once it stopped."""
    command = exec_form(dict(final_stage(dockerfile))["HEALTHCHECK"].split(" CMD ", 1)[1])
    with socket.socket() as closed, socket.socket() as probe:
        closed.bind(("127.0.0.1", 0))  # held, never listening: LAPGUARD_PORT
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        env = {
            **_image_environment(dockerfile, tmp_path),
            "LAPGUARD_PORT": str(closed.getsockname()[1]),
        }
        assert "LAPGUARD_STATE_FILE" in env, "the image must say where the server records its port"
        server = subprocess.Popen(
            [sys.executable, "-m", "training.cli.main", "serve", "--bundle", str(service_bundle),
             "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def health() -> int:
            return subprocess.run(
                [sys.executable, *command[1:]], cwd=ROOT, env=env, timeout=30
            ).returncode

        try:
            deadline = time.monotonic() + 90
            while _status(f"http://127.0.0.1:{port}/readyz") != 200:
                assert server.poll() is None and time.monotonic() < deadline, "not ready"
                time.sleep(0.2)
            assert health() == 0
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)
        finally:
            server.kill()
        assert not Path(env["LAPGUARD_STATE_FILE"]).exists()
        assert health() == 1


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
