"""`lapguard serve` as a subprocess: a tampered bundle stops start-up naming the file; a served
request is logged as JSON with its request id, and SIGTERM stops the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx
import pytest

from detector.errors import ConfigError
from service.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


def _serve(bundle: Path, *extra: str, log: IO[str] | None = None) -> subprocess.Popen:
    """``lapguard serve`` in a child process. Its log goes to a pipe, or to ``log`` (a file) for a
    server under load: a pipe nobody reads fills up and blocks the server's next log line."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("LAPGUARD_") or k == "LAPGUARD_DATA"
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "training.cli.main",
            "serve",
            "--bundle",
            str(bundle),
            "--device",
            "cpu",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log if log is not None else subprocess.PIPE,
        text=True,
    )


def _start_up_error(bundle: Path, *extra: str) -> str:
    """The last stderr line of a ``lapguard serve`` that must stop before listening."""
    process = _serve(bundle, "--port", "0", *extra)
    try:
        _, stderr = process.communicate(timeout=90)
    finally:
        process.kill()
    assert process.returncode != 0
    return stderr.strip().splitlines()[-1]


def test_tampered_bundle_stops_start_up_naming_the_file(service_bundle, tmp_path) -> None:
    tampered = tmp_path / "bundle"
    shutil.copytree(service_bundle, tampered)
    data = bytearray((tampered / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tampered / "model.safetensors").write_bytes(bytes(data))
    last = _start_up_error(tampered)
    assert (
        last.startswith("lapguard serve: error:")
        and "model.safetensors" in last
        and "checksum" in last
    )


def test_a_target_fpr_the_bundle_was_not_calibrated_at_stops_start_up(service_bundle) -> None:
    """`--target-fpr` picks one of the bundle's operating points; another target is refused
    before the server listens, naming the targets it offers (a bad value: what is allowed)."""
    for target, expected in (("0.0123", "calibrated at 0.05, 0.1"), ("1.5", "target_fpr")):
        last = _start_up_error(service_bundle, "--target-fpr", target)
        assert last.startswith("lapguard serve: error:") and expected in last, last


def test_serve_command_logs_json_with_request_ids_and_stops_on_sigterm(
    service_bundle, images
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = _serve(
        service_bundle, "--port", str(port), "--max-batch-size", "4", "--max-wait-ms", "1"
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        response = httpx.post(
            url + "/v1/predict",
            files={"files": ("a.png", images[0], "image/png")},
            headers={"X-Request-ID": "cli-req-1"},
        )
        assert response.status_code == 200, response.text
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode in (0, -signal.SIGTERM)
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    request = [r for r in records if r.get("request_id") == "cli-req-1"]
    assert request and request[0]["route"] == "/v1/predict" and request[0]["status"] == 200
    assert request[0]["duration_ms"] > 0 and request[0]["level"] == "info"
    assert any(r["message"] == "ready" for r in records)


def test_a_removed_setting_is_refused_naming_what_replaced_it(monkeypatch) -> None:
    """A variable of a setting that no longer exists would be ignored without a word: refused."""
    monkeypatch.setenv("LAPGUARD_QUERY_DISTANCE", "0.05")
    with pytest.raises(ConfigError, match="LAPGUARD_QUERY_DISTANCE.*LAPGUARD_QUERY_LEVELS"):
        load_settings()
    monkeypatch.delenv("LAPGUARD_QUERY_DISTANCE")
    assert load_settings().query_levels == 4


@pytest.mark.parametrize(
    ("formats", "message"),
    [('["PNG", "JPG"]', "unknown image format.*JPG.*JPEG"), ("[]", "at least one image format")],
)
def test_image_formats_pillow_cannot_open_are_refused_at_start(
    monkeypatch, formats: str, message: str
) -> None:
    """An unknown name would fail every upload of another format with a 500; none would refuse
    every upload: both are refused when the settings load."""
    monkeypatch.setenv("LAPGUARD_IMAGE_FORMATS", formats)
    with pytest.raises(ConfigError, match=message):
        load_settings()
    monkeypatch.setenv("LAPGUARD_IMAGE_FORMATS", '["png", "jpeg"]')
    assert load_settings().image_formats == ("PNG", "JPEG")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("LAPGUARD_QUERY_COOLDOWN_S", "inf", "query_cooldown_s: Input should be a finite number"),
        ("LAPGUARD_GRACEFUL_TIMEOUT_S", "nan", "graceful_timeout_s: Input should be a finite"),
        ("LAPGUARD_API_KEY", "secret-key\n", "api_key.*surrounding whitespace"),
        ("LAPGUARD_ADMIN_KEY", "clé", "admin_key.*not printable ASCII"),
    ],
)
def test_settings_that_would_break_at_run_time_are_refused_at_start(
    monkeypatch, name: str, value: str, message: str
) -> None:
    """An infinite cool-down made every refusal a 500 (its Retry-After); a key with a trailing
    newline (a secret file's) or non-ASCII letters locked every client out. The refusal does
    not show the key."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message) as refused:
        load_settings()
    assert "secret-key" not in str(refused.value) and "clé" not in str(refused.value)
