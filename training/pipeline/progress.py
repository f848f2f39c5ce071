"""``RUN/progress.json``: which step of a pipeline run is under way, so that another process (the
demo's server, a page polling ``GET /v1/model``) can show how far the run is.

The file is rewritten atomically when a step starts and when it ends::

    {"preset": "quick", "step": "attack lap/cw", "done": 7, "total": 23,
     "state": "running", "started": "2026-11-23T14:00:00+00:00",
     "updated": "2026-11-23T14:12:31+00:00", "message": null}

``state`` is ``running``, ``done`` or ``failed`` (then ``message`` says why; an interrupted run is
``failed`` too, and resumes when run again).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from detector import artefacts
from training.timings import record_step, utc_now

State = Literal["running", "done", "failed"]


class PipelineProgress:
    """Writes ``path`` as the steps of one pipeline run (``total`` of them) start and end, and
    appends each finished step's wall seconds to ``timings`` (:mod:`training.timings`) if given."""

    def __init__(self, path: Path, *, preset: str, total: int, timings: Path | None = None) -> None:
        self.path = Path(path)
        self.timings = timings
        self.preset = preset
        self.total = total
        self.done = 0
        self.started = utc_now()
        self.current = "start"  # the step under way, or the last one
        self.failed = False

    def write(self, step: str, state: State, message: str | None = None) -> None:
        """Rewrite the file (atomically: a reader sees the old or the new content)."""
        payload: dict[str, Any] = {
            "preset": self.preset,
            "step": step,
            "done": self.done,
            "total": self.total,
            "state": state,
            "started": self.started,
            "updated": utc_now(),
            "message": message,
        }
        artefacts.write_json(self.path, payload)

    @contextmanager
    def run(self) -> Iterator[None]:
        """The whole run: an exception between steps too (a Ctrl-C right after a step's last
        write) marks the run failed, so the file never says running for a run that stopped."""
        try:
            yield
        except BaseException as error:
            if not self.failed:
                self.fail(error)
            raise

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Mark step ``name`` running, then count it done; an exception (Ctrl-C included) marks
        the run failed with its message and propagates."""
        self.current = name
        self.write(name, "running")
        started = time.perf_counter()
        try:
            yield
        except BaseException as error:
            self.fail(error)
            raise
        if self.timings is not None:
            record_step(self.timings, name, time.perf_counter() - started)
        self.done += 1
        self.write(name, "running" if self.done < self.total else "done")

    def fail(self, error: BaseException) -> None:
        """Write the run failed at the current step, with why."""
        message = (
            "interrupted; run the pipeline again to resume"
            if isinstance(error, KeyboardInterrupt)
            else f"{type(error).__name__}: {error}"
        )
        self.failed = True
        self.write(self.current, "failed", message)
