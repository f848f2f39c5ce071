"""`lapguard demo`: a server that answers at once, and demo samples to send it.

The demo serves the bundle of a small first preset (``smoke``: ~1 min to build) while the final
preset's pipeline (``quick``) runs in the background, then switches the server to the final
bundle by itself (:mod:`training.cli.background`). Each run's demo samples are a clean test image
the bundle passes and an adversarial one it flags, as PNGs in ``RUN/demo``.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from pydantic import SecretStr

from detector.artefacts import read_json
from detector.errors import ArtefactError, ConfigError, LapguardError
from detector.guard import Guard
from detector.preprocessing import quantize_uint8
from service.server import serve
from service.settings import Settings, load_settings
from training.attacks import sets as adversarial
from training.cli.background import BackgroundPipeline, BundleSwitcher, wait_ready
from training.data.network_images import attack_images
from training.pipeline.run import run_pipeline
from training.pipeline.steps import default_run_dir, preset_config
from training.presets.pipelines import PipelineConfig
from training.rundir import RunDir

CANDIDATES = 200


def _save_png(image: np.ndarray, path: Path) -> Path:
    pixels = np.round(image * 255).astype(np.uint8)
    Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)).save(path)
    return path


def write_demo_samples(
    config: PipelineConfig, run: Path, out: Path, *, root: Path | None = None
) -> dict[str, Path]:
    """``clean.png``: a correctly classified test image the bundle does not flag; ``adversarial.png``:
    its attacked copy (8-bit, as a client sends it) that fools the network and is flagged."""
    model_dir = RunDir(run).model(config.deploy_model)
    key = (config.deploy_attacks or [a.key for a in config.attacks])[0]
    spec = next(a for a in config.attacks if a.key == key)
    x, y, indices = attack_images(model_dir, n=spec.n, root=root)
    attacked = adversarial.get_or_generate(
        RunDir(run).attacks(config.deploy_model),
        model_dir,
        x,
        y,
        indices,
        spec.attack,
        spec.params,
        progress=False,
    )
    rows = np.arange(len(x))[-CANDIDATES:]  # the last rows of the seeded order
    guard = Guard.from_bundle(run / "bundle", device="cpu")
    value_range = guard.input_spec.value_range
    clean = quantize_uint8(x[rows], value_range)
    adv = quantize_uint8(attacked.x_adv[rows], value_range)
    on_clean, on_adv = guard.predict(clean), guard.predict(adv)
    good = (
        (on_clean.labels == y[rows])
        & ~on_clean.flagged
        & (on_adv.labels != y[rows])
        & on_adv.flagged
    )
    out.mkdir(parents=True, exist_ok=True)
    if not good.any():
        return {"clean": _save_png(clean[0], out / "clean.png")}
    pick = int(np.flatnonzero(good)[0])
    return {
        "clean": _save_png(clean[pick], out / "clean.png"),
        "adversarial": _save_png(adv[pick], out / "adversarial.png"),
    }


def prepare_demo(config: PipelineConfig, run: Path, *, root: Path | None = None) -> dict[str, Path]:
    """Run (or reuse) the pipeline ``config`` in ``run``, then write its demo samples to
    ``run/demo``; return them by kind (``clean``, and ``adversarial`` when one was found)."""
    run_pipeline(config, run, root=root)
    return write_demo_samples(config, run, run / "demo", root=root)


def demo_instructions(run: Path, samples: dict[str, Path], port: int) -> list[str]:
    """Where the report and bundle are, and the curl commands to try once the server is up."""
    url = f"http://127.0.0.1:{port}"
    return [
        "",
        f"report: {run / 'report.md'}",
        f"bundle: {run / 'bundle'}",
        "",
        "Once the server says it is ready, try:",
        *(
            f"  curl -s -F files=@{path} {url}/v1/predict    # {kind} image"
            for kind, path in samples.items()
        ),
        f"  curl -s {url}/readyz;  curl -s {url}/metrics | head",
        "",
    ]


# ---- the demo: serve the first bundle now, switch to the final one when it is built -------------
@dataclass(frozen=True)
class DemoOptions:
    """What ``lapguard demo`` was asked: the final preset and its run directory, the first preset
    served while the final one is built, the data root, the port, and whether to serve at all."""

    preset: str = "quick"
    first_preset: str = "smoke"
    out: Path | None = None
    first_out: Path | None = None
    root: Path | None = None
    port: int = 8000
    serve: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def is_finished(run: Path) -> bool:
    """Whether ``run`` holds a finished pipeline run: its bundle is written and no progress file
    says a run is under way or failed there (runs from before progress files have none)."""
    layout = RunDir(run)
    if not layout.bundle_manifest.is_file():
        return False
    try:
        return bool(read_json(layout.progress_file)["state"] == "done")
    except (ArtefactError, KeyError, TypeError):
        return not layout.progress_file.exists()


def demo_settings(bundle: Path, port: int, progress_file: Path | None = None) -> Settings:
    """Server settings for the demo: loopback, ``LAPGUARD_*`` from the environment, an admin key
    so the demo can reload the server (a random one unless an admin or API key is set), and the
    log at warning unless ``LAPGUARD_LOG_LEVEL`` says otherwise."""
    settings = load_settings(
        bundle=bundle, host="127.0.0.1", port=port, progress_file=progress_file
    )
    if settings.admin_key is None and settings.api_key is None:
        settings = settings.model_copy(update={"admin_key": SecretStr(secrets.token_urlsafe(24))})
    if "LAPGUARD_LOG_LEVEL" not in os.environ:  # the page polls: one access line each would
        settings = settings.model_copy(update={"log_level": "warning"})  # bury the demo's lines
    return settings


def announce_ready(url: str, started: float, say: Callable[[str], None]) -> threading.Thread:
    """A thread that says when the server at ``url`` is ready, timed from ``started``."""

    def watch() -> None:
        if wait_ready(url):
            say(f"ready: {url}/ answers, {time.monotonic() - started:.0f} s after start")

    thread = threading.Thread(target=watch, name="lapguard-demo-ready", daemon=True)
    thread.start()
    return thread


def run_demo(options: DemoOptions, *, say: Callable[[str], None] = print) -> None:
    """Print the page's address; serve the final preset's bundle when its run is finished, else
    the first preset's (run or reused here) while the final one is built in the background; the
    server switches to it when it is ready. Ctrl-C stops the server and the background run."""
    started = time.monotonic()
    final = preset_config(options.preset)
    final_run = options.out or default_run_dir(final)
    if not options.serve:
        samples = prepare_demo(final, final_run, root=options.root)
        say("\n".join(demo_instructions(final_run, samples, options.port)))
        return
    say(f"lapguard demo: the page is at {options.url}/")
    finished = is_finished(final_run)
    if finished or options.first_preset == options.preset:
        samples = (
            write_demo_samples(final, final_run, final_run / "demo", root=options.root)
            if finished
            else prepare_demo(final, final_run, root=options.root)
        )
        say("\n".join(demo_instructions(final_run, samples, options.port)))
        _serve(demo_settings(final_run / "bundle", options.port), options, started, say)
        return
    first = preset_config(options.first_preset)
    first_run = options.first_out or default_run_dir(first)
    say(f"building (or reusing) the {first.name} bundle first, in {first_run}")
    samples = prepare_demo(first, first_run, root=options.root)
    say("\n".join(demo_instructions(first_run, samples, options.port)))
    settings = demo_settings(
        RunDir(first_run).bundle, options.port, progress_file=RunDir(final_run).progress_file
    )
    _serve_while_building(settings, options, final_run, started, say)


def _serve_while_building(
    settings: Settings,
    options: DemoOptions,
    final_run: Path,
    started: float,
    say: Callable[[str], None],
) -> None:
    """Serve ``settings.bundle`` while the final preset is built in a subprocess; switch to it."""
    key = settings.admin_key or settings.api_key
    if key is None:  # demo_settings always sets one
        raise ConfigError("the demo needs an admin key to switch bundles")
    final = preset_config(options.preset)
    pipeline = BackgroundPipeline(final.name, final_run, root=options.root).start()
    duration = f" ({final.expected_duration})" if final.expected_duration else ""
    say(
        f"building the {final.name} bundle in the background{duration}: progress in "
        f"{final_run / 'progress.json'} (and GET /v1/model 'building'), log in {pipeline.log}; "
        "the server switches to it when it is ready"
    )

    def on_switch(_: dict) -> None:
        try:
            samples = write_demo_samples(final, final_run, final_run / "demo", root=options.root)
        except LapguardError as error:
            say(f"no demo images for the {final.name} bundle: {error}")
            return
        say("\n".join(demo_instructions(final_run, samples, options.port)))

    switcher = BundleSwitcher(
        pipeline,
        options.url,
        key.get_secret_value(),
        say=say,
        on_switch=on_switch,
        started_at=started,
    )
    switcher.start()
    try:
        _serve(settings, options, started, say)
    finally:
        interrupted = pipeline.running
        switcher.stop()
        if interrupted:
            say(
                f"the {final.name} run stopped; `lapguard demo` (or `lapguard pipeline`) resumes it"
            )


def _serve(
    settings: Settings, options: DemoOptions, started: float, say: Callable[[str], None]
) -> None:
    announce_ready(options.url, started, say)
    serve(settings)
