"""`POST /v1/predict` on a live server: multipart and JSON base64 bodies give the in-process
Guard's answers, and concurrent single-image requests share forward passes."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tests.service_helpers import assert_matches, expected


def test_predict_multipart_matches_the_guard_in_process(client, guard, images) -> None:
    names = [f"img{i}.png" for i in range(len(images))]
    response = client.post(
        "/v1/predict",
        files=[("files", (n, b, "image/png")) for n, b in zip(names, images, strict=True)],
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == {"name": "tiny", "version": "7"}
    assert_matches(body["results"], expected(guard, images), names)


def test_predict_json_base64_matches_the_guard(client, guard, images) -> None:
    payload = {"instances": [{"b64": base64.b64encode(b).decode()} for b in images[:3]]}
    response = client.post("/v1/predict", json=payload)
    assert response.status_code == 200, response.text
    assert_matches(response.json()["results"], expected(guard, images[:3]), [None] * 3)


def test_concurrent_single_image_requests_are_batched_and_correct(
    client, server, guard, images
) -> None:
    reference = expected(guard, images[:5])
    before = server.runtime.metrics.batch_size.collect()[0].samples

    def one(i: int) -> dict:
        r = client.post("/v1/predict", files={"files": ("x.png", images[i % 5], "image/png")})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    assert [r["label"] for r in results] == [int(reference.labels[i % 5]) for i in range(48)]
    np.testing.assert_allclose(
        [r["score"] for r in results], [reference.scores[i % 5] for i in range(48)], atol=1e-5
    )
    after = server.runtime.metrics.batch_size.collect()[0].samples
    count = {s.name: s.value for s in after}["lapguard_batch_size_count"] - {
        s.name: s.value for s in before
    }["lapguard_batch_size_count"]
    assert count < 48, "concurrent requests should share forward passes"
