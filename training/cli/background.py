"""The demo's second act: a pipeline run in a subprocess, and the thread that switches a live
server to its bundle (``POST /v1/admin/reload`` on loopback) once the run has succeeded.

The subprocess writes to ``RUN/pipeline.log`` (a file, never an unread pipe, which would block
it once full) and its progress to ``RUN/progress.json``; it runs in its own session, so a Ctrl-C
in the terminal reaches the demo alone, which then interrupts it (SIGINT: the pipeline stops
between two of its cached steps' writes and resumes when run again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from training.rundir import RunDir

#: Niceness of the background pipeline: the server answering the page keeps the CPU it needs.
NICENESS = 10


#: The subprocess's entry point: ``lapguard`` with Ctrl-C (SIGINT) as KeyboardInterrupt even when
#: the demo was started with SIGINT ignored (as a script's background job is), which the child
#: would inherit; :meth:`BackgroundPipeline.stop` relies on it to stop the run between writes.
_ENTRY = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from training.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


class BackgroundPipeline:
    """``lapguard pipeline --preset PRESET --out RUN`` in a subprocess."""

    def __init__(self, preset: str, run: Path, *, root: Path | None = None) -> None:
        self.preset = preset
        self.run = RunDir(run)
        self.root = root
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.run.pipeline_log

    def command(self) -> list[str]:
        command = [sys.executable, "-c", _ENTRY, "pipeline", "--preset", self.preset]
        command += ["--out", str(self.run.path), "--no-progress"]
        return command + (["--root", str(self.root)] if self.root is not None else [])

    def start(self) -> BackgroundPipeline:
        """Start the run; its output goes to :attr:`log` (appended: a resumed run keeps its past)."""
        self.run.path.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        with contextlib.suppress(AttributeError, OSError):  # not on this platform, or not allowed
            os.setpriority(os.PRIO_PROCESS, self.process.pid, NICENESS)
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self) -> int:
        if self.process is None:
            raise RuntimeError("the pipeline was not started")
        return self.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """Interrupt the run (SIGINT, as Ctrl-C would), then kill it after ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def reload_server(url: str, admin_key: str, bundle: Path, *, timeout: float = 600.0) -> dict:
    """Ask the server at ``url`` to serve ``bundle`` (verified and warmed up before the swap);
    return its answer (``previous``, ``current``, ``seconds``). Raises ``httpx.HTTPError``."""
    response = httpx.post(
        f"{url}/v1/admin/reload",
        json={"bundle": str(bundle.resolve())},
        headers={"X-API-Key": admin_key},
        timeout=timeout,
    )
    response.raise_for_status()
    return dict(response.json())


def wait_ready(url: str, *, timeout: float = 600.0, stop: threading.Event | None = None) -> bool:
    """Poll ``url``/readyz until it answers 200 (True), or ``timeout`` seconds pass or ``stop``
    is set (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


class BundleSwitcher(threading.Thread):
    """Waits for a :class:`BackgroundPipeline`; when it succeeded and wrote ``RUN/bundle``, has the
    server at ``url`` serve that bundle, then calls ``on_switch(answer)``. ``say`` gets one line
    per event (the switch, or where the log of a failed run is), timed from ``started_at``
    (``time.monotonic()``; default: now). :meth:`stop` ends the run quietly."""

    def __init__(
        self,
        pipeline: BackgroundPipeline,
        url: str,
        admin_key: str,
        *,
        say: Callable[[str], None] = print,
        on_switch: Callable[[dict], None] | None = None,
        started_at: float | None = None,
    ) -> None:
        super().__init__(name="lapguard-bundle-switch", daemon=True)
        self.pipeline = pipeline
        self.url = url
        self.admin_key = admin_key
        self.say = say
        self.on_switch = on_switch
        self.started_at = time.monotonic() if started_at is None else started_at
        self.stopping = threading.Event()
        self.switched: dict | None = None

    def run(self) -> None:
        code = self.pipeline.wait()
        if self.stopping.is_set():
            return
        bundle = self.pipeline.run.bundle
        if code != 0 or not self.pipeline.run.bundle_manifest.is_file():
            self.say(
                f"the {self.pipeline.preset} pipeline stopped (exit status {code}); the served "
                f"bundle stays; see {self.pipeline.log}"
            )
            return
        self.switch(bundle)

    def switch(self, bundle: Path) -> None:
        """Reload the server with ``bundle``; say what now answers, with the time since start."""
        try:
            if not wait_ready(self.url, stop=self.stopping):
                raise httpx.ConnectError(f"{self.url} did not become ready")
            answer = reload_server(self.url, self.admin_key, bundle)
        except httpx.HTTPError as error:
            detail = error.response.text if isinstance(error, httpx.HTTPStatusError) else error
            self.say(f"could not switch to {bundle}: {detail}; the served bundle stays")
            return
        self.switched = answer
        current, elapsed = answer["current"], time.monotonic() - self.started_at
        self.say(
            f"switched to {current['name']} v{current['version']} ({bundle}) "
            f"{elapsed:.0f} s after start"
        )
        if self.on_switch is not None:
            self.on_switch(answer)

    def stop(self) -> None:
        """Stop the pipeline (resumable) and this thread, without a 'stopped' message."""
        self.stopping.set()
        self.pipeline.stop()
        self.join(timeout=30)
