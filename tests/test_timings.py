"""Where a run's time went: timings.jsonl lines from the progress tracker, and their sums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.pipeline.progress import PipelineProgress
from training.timings import grouped_minutes, read_timings, record_reference, step_seconds


def test_finished_steps_are_timed_and_a_failed_one_is_not(tmp_path: Path) -> None:
    timings = tmp_path / "timings.jsonl"
    progress = PipelineProgress(tmp_path / "p.json", preset="p", total=3, timings=timings)
    with progress.step("train lap"):
        sum(range(200_000))
    with pytest.raises(ValueError), progress.step("attack lap/cw"):
        raise ValueError("boom")
    rows = read_timings(tmp_path)
    assert [r["step"] for r in rows] == ["train lap"]
    assert rows[0]["event"] == "step" and 0 < rows[0]["seconds"] < 60 and rows[0]["finished"]
    untimed = PipelineProgress(tmp_path / "q.json", preset="p", total=1)
    with untimed.step("only"):
        pass
    assert len(read_timings(tmp_path)) == 1  # no timings file given: nothing appended


def test_a_resumed_step_adds_up_and_the_groups_cover_every_step() -> None:
    rows = [
        {"event": "reference", "torch_seconds": 1.0, "forest_seconds": 1.0},
        {"event": "step", "step": "train lap", "seconds": 120.0},
        {"event": "step", "step": "attack lap/cw", "seconds": 60.0},
        {"event": "step", "step": "attack lap/cw", "seconds": 30.0},  # resumed after a stop
        {"event": "step", "step": "evaluate", "seconds": 600.0},
        {"event": "step", "step": "fit deployable", "seconds": 6.0},
        {"event": "step", "step": "report", "seconds": 12.0},
    ]
    seconds = step_seconds(rows)
    assert seconds == {
        "train lap": 120.0,
        "attack lap/cw": 90.0,
        "evaluate": 600.0,
        "fit deployable": 6.0,
        "report": 12.0,
    }
    minutes = dict(grouped_minutes(seconds))
    assert minutes["train the networks"] == 2.0 and minutes["attacks"] == 1.5
    assert minutes["evaluate (features, protocols, learning curves)"] == 10.0
    assert minutes["fit the deployable detector"] == 0.1
    assert minutes["results, report, bundle"] == 0.2 and minutes["total"] == pytest.approx(13.8)


def test_the_reference_workload_is_timed_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "timings.jsonl"
    row = record_reference(path)
    assert row["torch_seconds"] > 0 and row["forest_seconds"] > 0 and row["threads"] >= 1
    assert json.loads(path.read_text()) == row
    assert read_timings(tmp_path / "nowhere") == []  # a run from before timings.jsonl
