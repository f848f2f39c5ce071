"""``lapguard score``: one request, resolved against the settings, run by the engine it names.

The CLI parses its flags into a :class:`ScoreRequest` and calls :func:`score`; what the flags
leave out (the bundle, the API key) comes from :class:`service.settings.Settings`
(``LAPGUARD_BUNDLE``, ``LAPGUARD_API_KEY``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from detector.errors import ConfigError
from service.batch.inputs import InputLike
from service.batch.runner import RunOptions, ScoringSummary
from service.batch.writer import Format
from service.settings import Settings, load_settings


@dataclass(frozen=True)
class ScoreRequest:
    """What to score, where to, and on which engine: local (``bundle``), a running server
    (``url``) or Ray (``engine="ray"`` with a bundle). None means 'not given': the batch size
    defaults per engine, the format from the output's suffix, bundle and API key from the
    settings."""

    inputs: Sequence[InputLike]
    out: Path = Path("results.jsonl")
    bundle: Path | None = None
    url: str | None = None
    engine: Literal["local", "ray"] = "local"
    fmt: Format | None = None
    batch_size: int | None = None
    workers: int = 2  # data-loading processes, or Ray actors
    device: str = "auto"
    target_fpr: float | None = None  # the bundle's operating point (local and Ray engines)
    ray_address: str | None = None
    concurrency: int = 4
    retries: int = 5
    timeout: float = 60.0
    api_key: str | None = None
    progress: bool = True
    retry_errors: bool = False

    def run_options(self) -> RunOptions:
        """The options of the run: csv for a ``.csv`` output unless a format is given."""
        fmt = self.fmt or ("csv" if self.out.suffix.lower() == ".csv" else "jsonl")
        return RunOptions(fmt=fmt, progress=self.progress, retry_errors=self.retry_errors)


def score(request: ScoreRequest) -> ScoringSummary:
    """Run ``request`` on its engine; the summary of the run."""
    if not request.inputs:
        raise ConfigError("score needs INPUT paths or --dataset NAME")
    settings = load_settings(bundle=request.bundle, api_key=request.api_key)
    if request.url is not None:
        if request.engine != "local":
            raise ConfigError("--url scores on a server; --engine ray needs --bundle")
        if request.target_fpr is not None:
            raise ConfigError(
                "--url scores at the server's operating point: start it with "
                "`lapguard serve --target-fpr`, or score a --bundle here"
            )
        return _score_on_server(request, request.url, settings)
    if settings.bundle is None:
        raise ConfigError(
            "score needs --bundle DIR (or $LAPGUARD_BUNDLE), or --url of a running server"
        )
    if request.engine == "ray":
        from service.batch.ray import score_inputs_ray

        return score_inputs_ray(
            settings.bundle,
            request.inputs,
            request.out,
            batch_size=request.batch_size or 256,
            num_actors=request.workers,
            device=request.device,
            address=request.ray_address,
            target_fpr=request.target_fpr,
            **request.run_options(),
        )
    from detector.guard import Guard
    from service.batch.local import score_inputs

    return score_inputs(
        Guard.from_bundle(settings.bundle, device=request.device, target_fpr=request.target_fpr),
        request.inputs,
        request.out,
        batch_size=request.batch_size or 256,
        num_workers=request.workers,
        **request.run_options(),
    )


def _score_on_server(request: ScoreRequest, url: str, settings: Settings) -> ScoringSummary:
    from service.batch.http import score_url

    api_key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    return score_url(
        url,
        request.inputs,
        request.out,
        batch_size=request.batch_size or 32,
        concurrency=request.concurrency,
        retries=request.retries,
        timeout=request.timeout,
        api_key=api_key,
        **request.run_options(),
    )
