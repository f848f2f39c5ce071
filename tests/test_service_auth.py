"""The API key: required on inference routes (X-API-Key or Bearer), not on health and metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.service_helpers import (
    API_KEY,
    INFERENCE_PATHS,
    client_error_has_www_authenticate,
    error_code,
    upload,
    v2_request,
)

#: Keys presented in ways that must be refused, on every route that scores images.
REFUSED_KEYS: dict[str, dict[str, str | bytes]] = {
    "empty": {"X-API-Key": ""},
    "bearer without a token": {"Authorization": "Bearer"},
    "another scheme": {"Authorization": f"Token {API_KEY}"},
    "the key with a suffix": {"X-API-Key": API_KEY + "x"},
    "very long": {"X-API-Key": "k" * 65_536},
    "not ascii": {"X-API-Key": "clé".encode("latin-1")},
    # X-API-Key wins over Authorization: a wrong key is refused whatever comes beside it
    "wrong header beside a right bearer": {
        "X-API-Key": "wrong",
        "Authorization": f"Bearer {API_KEY}",
    },
}


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


@pytest.mark.parametrize("path", INFERENCE_PATHS)
@pytest.mark.parametrize("variant", list(REFUSED_KEYS))
def test_api_key_variants_are_refused(server, images, variant: str, path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        response = anonymous.post(path, headers=REFUSED_KEYS[variant], **upload(path, images[:1]))
        assert response.status_code == 401 and error_code(response) == "unauthorized"
        assert client_error_has_www_authenticate(response)
        assert anonymous.get("/readyz").status_code == 200


@pytest.mark.parametrize("path", INFERENCE_PATHS)
def test_the_bearer_scheme_is_case_insensitive(server, images, path: str) -> None:
    headers = {"Authorization": f"bEARER {API_KEY}"}
    response = httpx.post(
        server.url + path, headers=headers, timeout=30, **upload(path, images[:1])
    )
    assert response.status_code == 200, response.text
