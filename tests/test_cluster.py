"""Two `lapguard serve` replicas sharing one real Redis as their query memory, behind one nginx,
all on loopback (benchmarks/cluster.py starts and stops them): a query attack spread over both
replicas is caught as on one; a hot reload rolled over the replicas one by one under load
answers every request, each naming the version that computed it; a replica killed under load
loses no request (the balancer retries it on the other)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.cluster import Cluster
from tests import test_service_query_attack as query_attack
from tests.service_helpers import ADMIN_KEY, near_duplicates
from tests.test_service_reload import NEW_THRESHOLD, Answer, Bundles, Load, two_versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

K = query_attack.K
fashion = query_attack.fashion  # the fixture: Fashion-MNIST test images


@pytest.fixture(scope="module")
def versions(service_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundles:
    """Version 7, served at start, and version 8, whose every answer is flagged."""
    return two_versions(service_bundle, tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def cluster(versions: Bundles, redis_url: str) -> Iterator[Cluster]:
    """Two replicas of version 7 on one torch thread each, their query memory in a Redis
    database of their own, behind nginx. The tests run in file order: the last kills one."""
    env = {
        "LAPGUARD_QUERY_MEMORY": "redis",
        "LAPGUARD_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/7",
        "LAPGUARD_ADMIN_KEY": ADMIN_KEY,
        "LAPGUARD_MAX_BATCH_SIZE": "8",
        "LAPGUARD_MAX_WAIT_MS": "2",
        "LAPGUARD_TORCH_THREADS": "1",
    }
    with Cluster(versions.old, replicas=2, flags=["--device", "cpu"], env=env) as running:
        yield running


def _metric(url: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` at ``url``'s /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} at {url}")


def test_a_query_attack_spread_over_both_replicas_is_caught_as_on_one(
    cluster: Cluster, fashion: np.ndarray
) -> None:
    """The same stream as on one replica (test_service_query_attack): the first K near-duplicates
    pass, every later one is flagged, though the balancer alternates the replicas."""
    checks = "lapguard_query_check_duration_seconds_count"
    before = [_metric(url, checks) for url in cluster.replica_urls]
    attacks = [_metric(url, "lapguard_query_attacks_total") for url in cluster.replica_urls]
    flags = []
    for probe in near_duplicates(fashion[7], 2 * K, 0.01, seed=7):
        files = {"files": ("probe.png", query_attack._png(probe), "image/png")}
        response = httpx.post(cluster.url + "/v1/predict", files=files, timeout=30)
        assert response.status_code == 200, response.text
        flags.append(response.json()["results"][0]["query_attack"])
    assert flags == [False] * K + [True] * K
    served = [_metric(url, checks) - b for url, b in zip(cluster.replica_urls, before, strict=True)]
    assert min(served) >= 1 and sum(served) == 2 * K, served  # both replicas took part
    caught = sum(_metric(url, "lapguard_query_attacks_total") for url in cluster.replica_urls)
    assert caught - sum(attacks) == K


def _check_rollover(answers: list[Answer], versions: Bundles, started: float, done: float) -> None:
    """Every request answered 200 by one version, whole; version 7 before the rollover began,
    version 8 once it was done, both in between."""
    failed = [a for a in answers if a.status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    thresholds = {"7": versions.old_threshold, "8": NEW_THRESHOLD}
    for a in answers:
        assert a.version in thresholds and set(a.thresholds) == {thresholds[a.version]}, a
    before = {a.version for a in answers if a.sent < started}
    after = {a.version for a in answers if a.sent > done}
    assert before == {"7"} and after == {"8"}, (before, after)
    during = [a.version for a in answers if started <= a.sent <= done]
    assert "7" in during and "8" in during, during


def test_a_reload_rolled_over_the_replicas_answers_every_request(
    cluster: Cluster, versions: Bundles, images: list[bytes]
) -> None:
    load = Load(cluster.url, images[2], clients=4)
    try:
        time.sleep(1.0)
        started = time.monotonic()
        for url in cluster.replica_urls:  # one by one, the other keeps answering
            body = {"bundle": str(versions.new)}
            reload = httpx.post(url + "/v1/admin/reload", json=body, headers={"X-API-Key": ADMIN_KEY}, timeout=120)  # fmt: skip
            assert reload.status_code == 200, reload.text
            assert reload.json()["current"]["version"] == "8"
            time.sleep(0.5)
        done = time.monotonic()
        time.sleep(1.0)
    finally:
        answers = load.finish()
    _check_rollover(answers, versions, started, done)


def test_a_replica_killed_under_load_loses_no_request(
    cluster: Cluster, images: list[bytes]
) -> None:
    """SIGKILL resets the connections of the requests it held; nginx sends them to the other."""
    load = Load(cluster.url, images[0], clients=4)
    try:
        time.sleep(1.0)
        killed = time.monotonic()
        cluster.kill(1)
        time.sleep(2.0)
    finally:
        answers = load.finish()
    failed = [a for a in answers if a.status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    assert sum(a.sent > killed for a in answers) > 10
    assert cluster.servers[1].poll() is not None and cluster.servers[0].poll() is None
