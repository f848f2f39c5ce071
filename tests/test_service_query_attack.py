"""Stateful query-attack detection on live servers: `query_attack` in /v1 results (near-duplicate
and Square-like streams) and the /v2 output, the Prometheus counter, the OpenAPI schema, and with
`query_attack_action=429` two replicas sharing one real Redis refuse the client for the
cool-down."""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from detector.errors import LapguardError
from service.batch.http import score_url
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import LIMITS, encode, near_duplicates, square_like
from training.data.datasets import load_dataset, to_arrays

K = Settings().query_neighbours


@pytest.fixture(scope="module")
def fashion(data_root: Path) -> np.ndarray:
    images, _ = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 200, seed=1)
    return images


def _png(image: np.ndarray) -> bytes:
    return encode((image[0] * 255).round().astype(np.uint8))


def _settings(bundle: Path, **query: object) -> Settings:
    return Settings(bundle=bundle, device="cpu", max_batch_size=8, **LIMITS, **query)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def flagging_server(service_bundle: Path, guard) -> Iterator[LiveServer]:
    """In-process memory, action 'flag'; no API key, so the client is its address."""
    with LiveServer(_settings(service_bundle), guard=guard) as live:
        yield live


def _predict(url: str, blobs: list[bytes]) -> httpx.Response:
    files = [("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(blobs)]
    return httpx.post(url + "/v1/predict", files=files, timeout=30)


def _attacks_counted(server: LiveServer) -> float:
    return float(server.runtime.metrics.query_attacks._value.get())  # the counter's value


def _checks_timed(server: LiveServer) -> float:
    samples = server.runtime.metrics.query_check_seconds.collect()[0].samples
    return next(s.value for s in samples if s.name.endswith("_count"))


def test_v1_flags_a_near_duplicate_stream_and_counts_it(
    flagging_server: LiveServer, fashion: np.ndarray
) -> None:
    before, timed = _attacks_counted(flagging_server), _checks_timed(flagging_server)
    flags = []
    for probe in near_duplicates(fashion[0], 2 * K, 0.01, seed=0):
        response = _predict(flagging_server.url, [_png(probe)])
        assert response.status_code == 200, response.text
        flags.append(response.json()["results"][0]["query_attack"])
    assert flags == [False] * K + [True] * K
    assert _attacks_counted(flagging_server) - before == K
    assert _checks_timed(flagging_server) - timed == 2 * K  # one timed check per request


def test_v1_flags_a_square_like_stream(flagging_server: LiveServer, fashion: np.ndarray) -> None:
    """Square at eps = 0.1 as 8-bit PNGs: large squares, every query in one eps-ball."""
    flags = []
    for query in square_like(fashion[5], 3 * K, 0.1, seed=5):
        response = _predict(flagging_server.url, [_png(query)])
        assert response.status_code == 200, response.text
        flags.append(response.json()["results"][0]["query_attack"])
    assert flags == [False] * K + [True] * (2 * K)


def test_v1_does_not_flag_distinct_clean_images(
    flagging_server: LiveServer, fashion: np.ndarray
) -> None:
    flags = []
    for start in range(50, 146, 8):
        response = _predict(flagging_server.url, [_png(x) for x in fashion[start : start + 8]])
        assert response.status_code == 200, response.text
        flags += [r["query_attack"] for r in response.json()["results"]]
    assert len(flags) == 96 and not any(flags)


def test_v2_has_a_query_attack_output(flagging_server: LiveServer, fashion: np.ndarray) -> None:
    url = flagging_server.url + "/v2/models/tiny/infer"
    flags = []
    for probe in near_duplicates(fashion[1], K + 2, 0.01, seed=1):
        body = {"inputs": [{"name": "input", "shape": [1, 1, 28, 28], "datatype": "FP32"}]}
        body["inputs"][0]["data"] = probe.ravel().tolist()
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 200, response.text
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        assert outputs["query_attack"]["datatype"] == "BOOL"
        flags.append(outputs["query_attack"]["data"][0])
    assert flags == [False] * K + [True] * 2
    metadata = httpx.get(flagging_server.url + "/v2/models/tiny", timeout=10).json()
    assert "query_attack" in [o["name"] for o in metadata["outputs"]]


def test_openapi_documents_query_attack(flagging_server: LiveServer) -> None:
    schema = httpx.get(flagging_server.url + "/openapi.json", timeout=10).json()
    prediction = schema["components"]["schemas"]["Prediction"]
    assert "query_attack" in prediction["required"]
    assert prediction["properties"]["query_attack"]["type"] == "boolean"


def _redis_settings(bundle: Path, redis_url: str, **query: object) -> Settings:
    """The query memory in the Redis at ``redis_url`` (shared by every server so set)."""
    return _settings(bundle, query_memory="redis", redis_url=redis_url, **query)


def test_replicas_sharing_redis_refuse_an_attacking_client_for_the_cool_down(
    service_bundle: Path, guard, redis_url: str, fashion: np.ndarray
) -> None:
    settings = _redis_settings(
        service_bundle, redis_url, query_attack_action="429", query_cooldown_s=1.0
    )
    with LiveServer(settings, guard=guard) as a, LiveServer(settings, guard=guard) as b:
        replicas = [a.url, b.url]
        probes = near_duplicates(fashion[2], K + 1, 0.01, seed=2)
        for i, probe in enumerate(probes[:K]):  # spread over both replicas
            assert _predict(replicas[i % 2], [_png(probe)]).status_code == 200
        refused = _predict(replicas[K % 2], [_png(probes[K])])
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "query_attack"
        assert int(refused.headers["Retry-After"]) >= 1
        # the other replica refuses the client too, even for a distinct image
        distinct = _predict(replicas[(K + 1) % 2], [_png(fashion[100])])
        assert distinct.status_code == 429
        time.sleep(1.1)
        again = _predict(replicas[0], [_png(fashion[101])])
        assert again.status_code == 200, again.text
        assert again.json()["results"][0]["query_attack"] is False


def test_v2_refusal_uses_the_inference_protocol_error_shape(
    service_bundle: Path, guard, redis_url: str, fashion: np.ndarray
) -> None:
    settings = _redis_settings(
        service_bundle,
        redis_url,
        query_attack_action="403",
        query_cooldown_s=30.0,
        query_client="address",
    )
    with LiveServer(settings, guard=guard) as live:
        url = live.url + "/v2/models/tiny/infer"
        statuses = []
        for probe in near_duplicates(fashion[3], K + 2, 0.01, seed=3):
            payload = base64.b64encode(_png(probe)).decode()
            body = {
                "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [payload]}]
            }
            response = httpx.post(url, json=body, timeout=30)
            statuses.append(response.status_code)
        assert statuses == [200] * K + [403, 403]
        assert response.json()["code"] == "query_attack"
        assert isinstance(response.json()["error"], str)


def test_an_unreachable_redis_serves_unchecked_and_counts_it(
    service_bundle: Path, guard, fashion: np.ndarray
) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    settings = _redis_settings(service_bundle, f"redis://127.0.0.1:{closed}/0")
    with LiveServer(settings, guard=guard) as live:
        response = _predict(live.url, [_png(fashion[4])])
        assert response.status_code == 200, response.text
        assert response.json()["results"][0]["query_attack"] is False
        assert live.runtime.metrics.query_store_errors._value.get() == 1


def test_batch_scoring_stopped_as_a_query_attack_says_so_and_keeps_its_rows(
    service_bundle: Path, guard, fashion: np.ndarray, tmp_path: Path
) -> None:
    """``lapguard score --url`` on a folder of near-duplicates against a server that refuses
    query attacks (403): the run stops with what to do (not "pass --api-key"), and the rows
    answered before the refusal are in the output for a resumed run."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i, probe in enumerate(near_duplicates(fashion[3], K + 2, 0.01, seed=3)):
        (folder / f"{i:02d}.png").write_bytes(_png(probe))
    settings = _settings(service_bundle, query_attack_action="403", query_client="address")
    out = tmp_path / "rows.jsonl"
    refused = "403.*re-run the same command after the cool-down"
    with LiveServer(settings, guard=guard) as live, pytest.raises(LapguardError, match=refused):
        score_url(live.url, [folder], out, batch_size=1, concurrency=1, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == K and not any(r.get("error") for r in rows)
