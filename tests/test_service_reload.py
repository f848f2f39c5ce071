"""Bundle hot reload on a live server: swapped under load with no failed request, by the admin
call and by SIGHUP to `lapguard serve`; the batch being computed finishes on the old Guard; a bad
bundle is refused and the old one keeps answering; the admin call needs its key; a reload makes
ready a server whose start-up warm-up failed, and lets the start-up bundle be collected."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from detector.artefacts import sha256_file
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import (
    ADMIN_KEY,
    API_KEY,
    LIMITS,
    error_code,
    error_message,
    flip_last_byte,
    rewrite_bundle,
)
from tests.test_service_cli import _serve
from tests.test_service_lifecycle import SlowGuard

NEW_THRESHOLD = -1.0  # every score is above it: all of version 8's answers are flagged
ADMIN = {"X-API-Key": ADMIN_KEY}


@dataclass
class Bundles:
    old: Path  # version 7, the served one
    new: Path  # version 8, threshold NEW_THRESHOLD
    old_threshold: float


def two_versions(service_bundle: Path, root: Path) -> Bundles:
    """Copies of ``service_bundle`` under ``root``: version 7 as it is, and version 8 with
    :data:`NEW_THRESHOLD`."""
    old = rewrite_bundle(service_bundle, root / "v7")
    new = rewrite_bundle(service_bundle, root / "v8", version="8", threshold=NEW_THRESHOLD)
    threshold = json.loads((old / "manifest.json").read_text())["threshold"]
    return Bundles(old=old, new=new, old_threshold=threshold)


@pytest.fixture(scope="module")
def bundles(service_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundles:
    return two_versions(service_bundle, tmp_path_factory.mktemp("reload"))


def _settings(bundle: Path, **keys: str) -> Settings:
    return Settings(bundle=bundle, device="cpu", max_batch_size=8, max_wait_ms=2, **LIMITS, **keys)


@dataclass
class Answer:
    sent: float
    status: int
    version: str | None = None
    thresholds: tuple[float, ...] = ()
    flagged: tuple[bool, ...] = ()


def _hammer(url: str, stop: threading.Event, image: bytes, headers: dict) -> list[Answer]:
    """Send /v1/predict back to back until ``stop``; a transport error counts as status 0."""
    answers = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = c.post("/v1/predict", files={"files": ("a.png", image, "image/png")})
            except httpx.HTTPError:
                answers.append(Answer(sent, 0))
                continue
            if r.status_code != 200:
                answers.append(Answer(sent, r.status_code))
                continue
            body = r.json()
            results = body["results"]
            answers.append(
                Answer(
                    sent,
                    200,
                    body["model"]["version"],
                    tuple(x["threshold"] for x in results),
                    tuple(x["flagged"] for x in results),
                )
            )
    return answers


class Load:
    """``clients`` threads sending /v1/predict back to back while the block runs."""

    def __init__(self, url: str, image: bytes, headers: dict | None = None, clients: int = 4):
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [
            self.pool.submit(_hammer, url, self.stop, image, headers or {}) for _ in range(clients)
        ]

    def finish(self) -> list[Answer]:
        self.stop.set()
        answers = [a for f in self.futures for a in f.result(timeout=60)]
        self.pool.shutdown()
        return answers


def _check_answers(answers: list[Answer], bundles: Bundles, swapped_at: float) -> None:
    """No request failed; each answer is wholly one bundle's; every request sent after the swap
    returned was answered by version 8."""
    failed = [a for a in answers if a.status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    thresholds = {"7": bundles.old_threshold, "8": NEW_THRESHOLD}
    for a in answers:
        assert a.version in thresholds and set(a.thresholds) == {thresholds[a.version]}, a
        if a.version == "8":
            assert all(a.flagged), a
    versions = [a.version for a in answers]
    assert versions.count("7") > 0 and versions.count("8") > 0, versions
    after = [a.version for a in answers if a.sent > swapped_at]
    assert after and set(after) == {"8"}, after


def _metric(text: str, prefix: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return float(lines[0].rsplit(" ", 1)[1])


# ---- the admin call --------------------------------------------------------------------------
def test_admin_reload_under_load_loses_no_request(bundles, images) -> None:
    settings = _settings(bundles.old, api_key=API_KEY, admin_key=ADMIN_KEY)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        load = Load(live.url, images[0], {"X-API-Key": API_KEY})
        time.sleep(1.0)
        response = c.post("/v1/admin/reload", json={"bundle": str(bundles.new)}, headers=ADMIN)
        swapped_at = time.monotonic()
        time.sleep(1.0)
        answers = load.finish()
        assert response.status_code == 200, response.text
        body = response.json()
        sha = sha256_file(bundles.new / "manifest.json")
        assert body["previous"]["version"] == "7" and body["current"]["version"] == "8"
        assert body["current"]["sha256"] == sha and body["current"]["path"] == str(bundles.new)
        _check_answers(answers, bundles, swapped_at)

        model = c.get("/v1/model").json()
        assert (model["version"], model["sha256"], model["threshold"]) == ("8", sha, NEW_THRESHOLD)
        metrics = c.get("/metrics").text
        info = f'lapguard_bundle_info{{name="tiny",sha256="{sha}",version="8"}}'
        assert _metric(metrics, info) == 1.0
        assert _metric(metrics, 'lapguard_bundle_reloads_total{outcome="swapped"}') == 1.0
        # No body: the served directory is read again (a new manifest there would be taken).
        again = c.post("/v1/admin/reload", headers=ADMIN)
        assert again.status_code == 200 and again.json()["current"]["version"] == "8"


def test_the_batch_being_computed_finishes_on_the_old_guard(bundles, guard, images) -> None:
    """The old Guard takes 2 s per batch: a request in its batch during the swap is answered by
    version 7, after the swap returned; a request queued meanwhile runs in the next batch, on 8."""
    settings = _settings(bundles.old, admin_key=ADMIN_KEY, warmup=False)
    file = {"files": ("a.png", images[0], "image/png")}
    with (
        LiveServer(settings, guard=SlowGuard(guard, 2.0)) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
        ThreadPoolExecutor(2) as pool,
    ):
        in_flight = pool.submit(c.post, "/v1/predict", files=file)
        time.sleep(0.3)
        queued = pool.submit(c.post, "/v1/predict", files=file)
        time.sleep(0.2)
        response = c.post("/v1/admin/reload", json={"bundle": str(bundles.new)}, headers=ADMIN)
        assert response.status_code == 200 and response.json()["current"]["version"] == "8"
        assert not in_flight.done()  # the swap did not wait for the batch being computed
        first, second = in_flight.result(timeout=30), queued.result(timeout=30)
        assert first.status_code == 200 and first.json()["model"]["version"] == "7"
        assert first.json()["results"][0]["threshold"] == pytest.approx(bundles.old_threshold)
        assert second.status_code == 200 and second.json()["model"]["version"] == "8"
        assert second.json()["results"][0]["threshold"] == NEW_THRESHOLD


# ---- bad bundles -------------------------------------------------------------------------------
def _tampered(bundle: Path) -> None:
    flip_last_byte(bundle / "model.safetensors")


def _missing(bundle: Path) -> None:
    (bundle / "detector.safetensors").unlink()


def _other_inputs(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["input_spec"]["value_range"] = [0.0, 255.0]
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def _not_a_bundle(bundle: Path) -> None:
    for file in bundle.iterdir():
        file.unlink()
    bundle.rmdir()


@pytest.fixture(scope="module")
def keyed_server(bundles) -> Iterator[LiveServer]:
    with LiveServer(_settings(bundles.old, api_key=API_KEY, admin_key=ADMIN_KEY)) as live:
        yield live


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (_tampered, "checksum mismatch for bundle file model.safetensors"),
        (_missing, "detector.safetensors listed in the manifest is missing"),
        (_other_inputs, "value_range (0.0, 1.0) -> (0.0, 255.0)"),
        (_not_a_bundle, "does not exist"),
    ],
    ids=["tampered", "missing-file", "other-inputs", "no-directory"],
)
def test_a_bad_bundle_is_refused_and_the_old_one_keeps_answering(
    keyed_server, bundles, images, tmp_path, spoil, reason
) -> None:
    bad = rewrite_bundle(bundles.new, tmp_path / "bad")
    spoil(bad)
    headers = {"X-API-Key": API_KEY}
    with httpx.Client(base_url=keyed_server.url, timeout=60) as c:
        refused_before = _metric(
            c.get("/metrics").text, 'lapguard_bundle_reloads_total{outcome="refused"}'
        )
        load = Load(keyed_server.url, images[1], headers, clients=2)
        response = c.post("/v1/admin/reload", json={"bundle": str(bad)}, headers=ADMIN)
        time.sleep(0.3)
        answers = load.finish()
        assert response.status_code == 422 and error_code(response) == "bundle_refused"
        message = error_message(response)
        assert reason in message and "still serving tiny version 7" in message, message
        assert answers and all(a.status == 200 and a.version == "7" for a in answers)
        assert c.get("/v1/model").json()["version"] == "7"
        metrics = c.get("/metrics").text
        refused = _metric(metrics, 'lapguard_bundle_reloads_total{outcome="refused"}')
        assert refused == refused_before + 1
        assert 'lapguard_bundle_info{name="tiny",sha256=' in metrics and 'version="7"}' in metrics


# ---- who may reload -----------------------------------------------------------------------------
def test_the_admin_call_needs_the_admin_key(keyed_server, bundles) -> None:
    url = keyed_server.url + "/v1/admin/reload"
    for headers in ({}, {"X-API-Key": API_KEY}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(url, headers=headers, timeout=60)
        assert response.status_code == 401 and error_code(response) == "unauthorized", headers
        assert response.headers["www-authenticate"].startswith("Bearer")
    for headers in (ADMIN, {"Authorization": f"Bearer {ADMIN_KEY}"}):
        response = httpx.post(url, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    schema = httpx.get(keyed_server.url + "/openapi.json").json()
    operation = schema["paths"]["/v1/admin/reload"]["post"]
    assert {"200", "401", "403", "422", "503"} <= set(operation["responses"])
    assert "ReloadRequest" in json.dumps(operation["requestBody"])


def test_without_an_admin_key_the_api_key_reloads_and_without_any_key_none_can(bundles) -> None:
    with LiveServer(_settings(bundles.old, api_key=API_KEY)) as live:
        url = live.url + "/v1/admin/reload"
        assert httpx.post(url, timeout=60).status_code == 401
        assert httpx.post(url, headers={"X-API-Key": API_KEY}, timeout=60).status_code == 200
    with LiveServer(_settings(bundles.old)) as live:
        response = httpx.post(live.url + "/v1/admin/reload", timeout=60)
        assert response.status_code == 403 and error_code(response) == "forbidden"
        assert "LAPGUARD_ADMIN_KEY" in error_message(response)


# ---- what a reload leaves behind --------------------------------------------------------------
def test_a_reload_makes_ready_a_server_whose_warm_up_failed(bundles, images) -> None:
    """The start-up Guard's network has no weights in memory (moved to the meta device), so its
    warm-up fails and the server stays not ready; a reload of the bundle directory (whose
    network is whole) is warmed up before the swap, so the server is ready after it."""
    from detector.guard import Guard

    broken = Guard.from_bundle(bundles.old, device="cpu")
    broken.model.to("meta")
    settings = _settings(bundles.old, admin_key=ADMIN_KEY)
    with (
        LiveServer(settings, guard=broken, wait_for="/healthz") as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        time.sleep(0.5)
        assert c.get("/readyz").status_code == 503
        response = c.post("/v1/admin/reload", headers=ADMIN)
        assert response.status_code == 200, response.text
        assert c.get("/readyz").status_code == 200
        assert _metric(c.get("/metrics").text, "lapguard_ready ") == 1.0
        answer = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
        assert answer.status_code == 200, answer.text


def test_after_a_reload_the_start_up_bundle_is_collected(bundles, images) -> None:
    """The start-up heap is frozen (``gc.freeze``) once warm; the start-up network holds
    reference cycles, which only the cyclic collector frees: after a reload it must be collected
    (not kept frozen for the life of the process), and the heap is frozen again afterwards."""
    with (
        LiveServer(_settings(bundles.old, admin_key=ADMIN_KEY)) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        assert gc.get_freeze_count() > 10_000
        answer = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
        assert answer.status_code == 200  # a batch ran on the start-up Guard
        guard = weakref.ref(live.runtime.require_guard())
        network = weakref.ref(live.runtime.require_guard().model)
        response = c.post("/v1/admin/reload", json={"bundle": str(bundles.new)}, headers=ADMIN)
        assert response.status_code == 200, response.text

        def collected() -> bool:
            gc.collect()
            return guard() is None and network() is None

        _wait_for(collected, 20)
        _wait_for(lambda: gc.get_freeze_count() > 10_000, 20)  # frozen again
        assert live.runtime.require_guard().manifest.version == "8"


# ---- SIGHUP to `lapguard serve` -----------------------------------------------------------------
def _point(link: Path, target: Path) -> None:
    """Re-point the symlink ``link`` at ``target`` atomically (how a deployment swaps bundles)."""
    staging = link.with_name(link.name + ".new")
    staging.symlink_to(target)
    os.replace(staging, link)


def _wait_for(predicate, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sighup_reloads_the_served_directory_under_load(bundles, images, tmp_path) -> None:
    current = tmp_path / "current"
    current.symlink_to(bundles.old)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The log goes to a file: the load's repeated image is a query attack, one warning a request,
    # and an unread pipe would fill and block the server (what made this test hang before).
    log_path = tmp_path / "server.log"
    log = log_path.open("w")
    process = _serve(
        current, "--port", str(port), "--max-batch-size", "8", "--max-wait-ms", "2", log=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: process.poll() is None and _status(url + "/readyz") == 200, 90)
        load = Load(url, images[2])
        time.sleep(1.0)
        _point(current, bundles.new)
        process.send_signal(signal.SIGHUP)
        _wait_for(lambda: httpx.get(url + "/v1/model").json()["version"] == "8")
        swapped_at = time.monotonic()
        time.sleep(1.0)
        _check_answers(load.finish(), bundles, swapped_at)

        bad = rewrite_bundle(bundles.new, tmp_path / "tampered", version="9")
        _tampered(bad)
        _point(current, bad)
        process.send_signal(signal.SIGHUP)
        refused = 'lapguard_bundle_reloads_total{outcome="refused"}'
        _wait_for(lambda: _metric(httpx.get(url + "/metrics").text, refused) == 1.0)
        answer = httpx.post(url + "/v1/predict", files={"files": ("a.png", images[0], "image/png")})
        assert answer.status_code == 200 and answer.json()["model"]["version"] == "8"
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
        log.close()
    stderr = log_path.read_text()
    assert process.returncode in (0, -signal.SIGTERM), stderr[-2000:]
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    swapped = [r for r in records if r["message"] == "bundle reloaded"]
    assert len(swapped) == 1 and swapped[0]["version"] == "8"
    refusals = [r for r in records if r["message"].startswith("bundle reload refused")]
    assert len(refusals) == 1 and refusals[0]["level"] == "error"
    assert "checksum mismatch for bundle file model.safetensors" in refusals[0]["message"]


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
