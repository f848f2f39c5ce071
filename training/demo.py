"""Demo samples: a clean test image the bundle passes and an adversarial one it flags, as PNGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from detector.guard import Guard
from training import adversarial
from training.presets.pipelines import PipelineConfig
from training.rundir import RunDir

CANDIDATES = 200


def _as_8bit(images: np.ndarray) -> np.ndarray:
    """What a client sending PNGs would send: images rounded to 8 bits, back as floats."""
    return (np.round(np.clip(images, 0, 1) * 255) / 255).astype(np.float32)


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
    x, y, indices = adversarial.attack_images(model_dir, n=spec.n, root=root)
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
    clean, adv = _as_8bit(x[rows]), _as_8bit(attacked.x_adv[rows])
    guard = Guard.from_bundle(run / "bundle", device="cpu")
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
    from training.pipeline import run_pipeline

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
