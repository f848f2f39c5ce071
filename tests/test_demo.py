"""`lapguard demo` answers at once: a pipeline run writes RUN/progress.json step by step (failed,
with its message, when a step raises or is interrupted); GET /v1/model reports it as `building`
(null when the file is absent or unreadable); a pipeline run in a subprocess is watched and the
live server switched to its bundle through the admin call, or left serving when the run fails."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from detector.errors import DataNotFoundError
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import ADMIN_KEY, encode, rewrite_bundle, synthetic_images
from training.cli.background import BackgroundPipeline, BundleSwitcher
from training.cli.demo import demo_settings, is_finished
from training.evaluation.context import PipelineRun
from training.pipeline.progress import PipelineProgress
from training.pipeline.run import pipeline_steps, run_pipeline
from training.pipeline.steps import preset_config

SMOKE_STEPS = 9  # 2 networks + 2 x 1 attack set + evaluate, fit, results, report, bundle


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- progress.json -----------------------------------------------------------------------------
def test_progress_file_follows_the_steps_and_records_a_failure(tmp_path) -> None:
    path = tmp_path / "progress.json"
    progress = PipelineProgress(path, preset="p", total=3)
    with progress.step("first"):
        inside = _read(path)
    assert inside["step"] == "first" and inside["state"] == "running" and inside["done"] == 0
    assert _read(path)["done"] == 1 and _read(path)["state"] == "running"
    with pytest.raises(ValueError, match="boom"), progress.step("second"):
        raise ValueError("boom")
    failed = _read(path)
    assert failed["state"] == "failed" and failed["step"] == "second" and failed["done"] == 1
    assert failed["message"] == "ValueError: boom"
    assert failed["preset"] == "p" and failed["total"] == 3
    assert failed["started"] <= failed["updated"]


def test_progress_file_says_done_after_the_last_step_and_interrupted_on_ctrl_c(tmp_path) -> None:
    done = PipelineProgress(tmp_path / "a.json", preset="p", total=1)
    with done.step("only"):
        pass
    assert _read(tmp_path / "a.json") | {"started": None, "updated": None} == {
        "preset": "p",
        "step": "only",
        "done": 1,
        "total": 1,
        "state": "done",
        "started": None,
        "updated": None,
        "message": None,
    }
    stopped = PipelineProgress(tmp_path / "b.json", preset="p", total=2)
    with pytest.raises(KeyboardInterrupt), stopped.step("long"):
        raise KeyboardInterrupt
    assert _read(tmp_path / "b.json")["state"] == "failed"
    assert "interrupted" in _read(tmp_path / "b.json")["message"]
    between = PipelineProgress(tmp_path / "c.json", preset="p", total=2)
    with pytest.raises(KeyboardInterrupt), between.run():
        with between.step("first"):
            pass
        raise KeyboardInterrupt  # after a step's last write, before the next step starts
    assert _read(tmp_path / "c.json") | {"started": None, "updated": None} == {
        "preset": "p",
        "step": "first",
        "done": 1,
        "total": 2,
        "state": "failed",
        "started": None,
        "updated": None,
        "message": "interrupted; run the pipeline again to resume",
    }


def test_every_attack_set_is_a_step(tmp_path) -> None:
    names = [name for name, _ in pipeline_steps(PipelineRun(preset_config("quick"), tmp_path))]
    attacks = [a.key for a in preset_config("quick").attacks]
    assert names[:2] == ["train vanilla", "train lap"]
    assert names[2:-5] == [f"attack {m}/{k}" for m in ("vanilla", "lap") for k in attacks]
    assert names[-5:] == ["evaluate", "fit deployable", "results", "report", "bundle"]


def test_a_failing_pipeline_writes_failed_and_raises(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError):
        run_pipeline(preset_config("smoke"), tmp_path / "run", root=tmp_path / "empty")
    progress = _read(tmp_path / "run" / "progress.json")
    assert progress["state"] == "failed" and progress["step"] == "train vanilla"
    assert progress["done"] == 0 and progress["total"] == SMOKE_STEPS
    assert "not found" in progress["message"]
    assert not is_finished(tmp_path / "run")


# ---- GET /v1/model: building ---------------------------------------------------------------------
@pytest.fixture
def served(service_bundle: Path, tmp_path: Path) -> Iterator[tuple[LiveServer, Path]]:
    """A live server on the tiny bundle (version 7), told to report ``tmp/run/progress.json``."""
    progress = tmp_path / "run" / "progress.json"
    settings = Settings(
        bundle=rewrite_bundle(service_bundle, tmp_path / "v7"),
        device="cpu",
        admin_key=ADMIN_KEY,
        progress_file=progress,
    )
    with LiveServer(settings) as live:
        yield live, progress


def _model(live: LiveServer) -> dict:
    response = httpx.get(f"{live.url}/v1/model", timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_model_summary_reports_the_bundle_being_built(served) -> None:
    live, progress = served
    assert _model(live)["building"] is None  # no file yet
    progress.parent.mkdir()
    PipelineProgress(progress, preset="quick", total=23).write("attack lap/cw", "running")
    building = _model(live)["building"]
    assert building["preset"] == "quick" and building["step"] == "attack lap/cw"
    assert building["done"] == 0 and building["total"] == 23 and building["state"] == "running"
    assert building == _read(progress)
    for broken in ('{"preset": "quick", "st', '{"preset": "quick"}', "[]", "\xff"):
        progress.write_text(broken)
        assert _model(live)["building"] is None
    assert _model(live)["name"] == "tiny" and _model(live)["version"] == "7"


def test_model_summary_has_no_building_without_a_progress_file(server) -> None:
    from tests.service_helpers import API_KEY

    response = httpx.get(f"{server.url}/v1/model", headers={"X-API-Key": API_KEY}, timeout=30)
    assert response.status_code == 200 and response.json()["building"] is None


# ---- the switch ----------------------------------------------------------------------------------
def test_switch_reloads_the_live_server_through_the_admin_call(served, tmp_path) -> None:
    live, _ = served
    v8 = rewrite_bundle(live.settings.bundle, tmp_path / "v8", version="8")
    said: list[str] = []
    pipeline = BackgroundPipeline("smoke", tmp_path / "r")  # not started: switch() is called here
    wrong = BundleSwitcher(pipeline, live.url, "wrong-key", say=said.append)
    wrong.switch(v8)
    assert wrong.switched is None and "could not switch" in said[0]
    assert _model(live)["version"] == "7"

    switched: list[dict] = []
    switcher = BundleSwitcher(
        pipeline,
        live.url,
        ADMIN_KEY,
        say=said.append,
        on_switch=switched.append,
    )
    switcher.switch(v8)
    assert _model(live)["version"] == "8"
    assert switched[0]["previous"]["version"] == "7" and switched[0]["current"]["version"] == "8"
    assert said[-1].startswith("switched to tiny v8")


def test_demo_settings_carry_an_admin_key_and_a_quiet_log(service_bundle, monkeypatch) -> None:
    monkeypatch.delenv("LAPGUARD_ADMIN_KEY", raising=False)
    monkeypatch.delenv("LAPGUARD_API_KEY", raising=False)
    one, two = demo_settings(service_bundle, 8123), demo_settings(service_bundle, 8123)
    assert one.admin_key is not None and two.admin_key is not None
    assert len(one.admin_key.get_secret_value()) >= 24
    assert one.admin_key != two.admin_key and one.host == "127.0.0.1" and one.port == 8123
    monkeypatch.setenv("LAPGUARD_ADMIN_KEY", "mine")
    kept = demo_settings(service_bundle, 8123, progress_file=Path("p.json"))
    assert kept.admin_key is not None and kept.admin_key.get_secret_value() == "mine"
    assert kept.progress_file == Path("p.json")
    monkeypatch.delenv("LAPGUARD_LOG_LEVEL", raising=False)
    assert demo_settings(service_bundle, 8123).log_level == "warning"  # the page's polls stay quiet
    monkeypatch.setenv("LAPGUARD_LOG_LEVEL", "debug")
    assert demo_settings(service_bundle, 8123).log_level == "debug"


def test_a_failed_background_run_keeps_the_served_bundle(served, tmp_path) -> None:
    live, progress = served
    (tmp_path / "empty").mkdir()
    said: list[str] = []
    run = progress.parent
    pipeline = BackgroundPipeline("smoke", run, root=tmp_path / "empty").start()
    switcher = BundleSwitcher(pipeline, live.url, ADMIN_KEY, say=said.append)
    switcher.start()
    switcher.join(timeout=120)
    assert not switcher.is_alive() and switcher.switched is None
    assert said == [
        f"the smoke pipeline stopped (exit status 2); the served bundle stays; see {pipeline.log}"
    ]
    assert "not found" in pipeline.log.read_text()
    model = _model(live)
    assert model["version"] == "7" and model["building"]["state"] == "failed"


@pytest.mark.slow
def test_background_smoke_run_is_interrupted_resumed_and_switched_to(
    served, data_root, tmp_path
) -> None:
    """The real smoke pipeline in a subprocess: stopped (Ctrl-C) once its networks are trained,
    started again (it resumes), then watched: the server answers with the tiny bundle while `building` counts the steps, and
    with the smoke bundle once the run is done."""
    live, progress = served
    run = progress.parent
    first = BackgroundPipeline("smoke", run, root=data_root).start()
    _wait_for(lambda: progress.is_file() and _read(progress)["done"] >= 2, 120)  # trained
    first.stop()
    assert first.process is not None
    assert first.process.returncode == 130, first.log.read_text()[-3000:]  # why, if not
    assert _read(progress)["state"] == "failed" and "interrupted" in _read(progress)["message"]
    trained = (run / "models" / "lap" / "model.safetensors").stat().st_mtime_ns

    said: list[str] = []
    switcher = BundleSwitcher(
        BackgroundPipeline("smoke", run, root=data_root).start(),
        live.url,
        ADMIN_KEY,
        say=said.append,
    )
    switcher.start()
    seen: list[tuple[str, str, int]] = []
    while switcher.is_alive():
        model = _model(live)
        if model["building"] is not None:
            seen.append((model["name"], model["building"]["state"], model["building"]["done"]))
        time.sleep(0.5)
    assert any(name == "tiny" and state == "running" for name, state, _ in seen)
    # Until the resumed run writes its first step, the server reads the interrupted run's file.
    counted = [done for _, state, done in seen if state != "failed"]
    assert counted == sorted(counted)
    model = _model(live)
    assert model["name"] == "lapguard-smoke-lap" and switcher.switched is not None
    assert model["building"]["state"] == "done"
    assert model["building"]["done"] == model["building"]["total"] == SMOKE_STEPS
    assert said[-1].startswith("switched to lapguard-smoke-lap") and is_finished(run)
    assert (run / "models" / "lap" / "model.safetensors").stat().st_mtime_ns == trained  # resumed
    image = encode((synthetic_images(1, seed=0)[0, 0] * 255).round().astype("uint8"))
    answer = httpx.post(f"{live.url}/v1/predict", files={"files": ("a.png", image)}, timeout=30)
    assert answer.status_code == 200 and answer.json()["model"]["name"] == "lapguard-smoke-lap"


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
