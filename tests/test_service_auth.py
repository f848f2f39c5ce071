"""The API key: required on inference routes (X-API-Key or Bearer), not on health and metrics."""

from __future__ import annotations

import httpx

from tests.service_helpers import (
    API_KEY,
    client_error_has_www_authenticate,
    error_code,
    v2_request,
)


def test_api_key_is_required_on_inference_routes_only(server, images) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for headers in (
            {},
            {"X-API-Key": "wrong"},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic abc"},
        ):
            response = anonymous.post(
                "/v1/predict", files={"files": ("a.png", images[0], "image/png")}, headers=headers
            )
            assert (
                response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
            )
            assert client_error_has_www_authenticate(response)
        refused = anonymous.post("/v2/models/tiny/infer", **v2_request([1, 1, 28, 28], 784))
        assert refused.status_code == 401 and error_code(refused) == "unauthorized"
        ok = anonymous.post(
            "/v1/predict",
            files={"files": ("a.png", images[0], "image/png")},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert ok.status_code == 200
        assert (
            anonymous.get("/readyz").status_code == 200
            and anonymous.get("/metrics").status_code == 200
        )
