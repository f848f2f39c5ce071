"""Loading a bundle to serve, for start-up and for hot reload (SIGHUP, ``POST /v1/admin/reload``).

:func:`load_served` verifies the bundle (every checksum, through :func:`detector.bundle.load_bundle`),
builds its Guard and runs it forward before anything is swapped; :func:`check_compatible` refuses a
bundle that would take other inputs than the one served, since requests already queued were
converted to the served input spec. The :class:`ServedBundle` is replaced whole, so one reference
says which Guard, version and checksum answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from detector.artefacts import sha256_file
from detector.bundle import MANIFEST_FILE
from detector.errors import ArtefactError
from detector.networks import RESIZE_POLICY

if TYPE_CHECKING:
    from detector.guard import Guard


@dataclasses.dataclass(frozen=True)
class ServedBundle:
    """What answers: a loaded Guard, the directory it came from and the sha256 of its
    ``manifest.json`` (which lists the sha256 of every other file). Replaced whole on reload."""

    guard: Guard
    path: Path | None = None
    sha256: str | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.guard.manifest, "name", None) or "lapguard")

    @property
    def version(self) -> str:
        return str(getattr(self.guard.manifest, "version", None) or "1")


def load_served(
    path: Path, *, device: str, warmup_sizes: Sequence[int], target_fpr: float | None = None
) -> ServedBundle:
    """Verify and load the bundle at ``path``, flagging at its operating point for
    ``target_fpr`` (None: its own), and run its Guard once per batch size (blocking; run it in
    a worker thread). Raises :class:`ArtefactError` (or :class:`ConfigError`: no such operating
    point) naming the problem."""
    from detector.guard import Guard

    manifest = Path(path) / MANIFEST_FILE
    before = sha256_file(manifest) if manifest.is_file() else None
    # verifies the manifest and every checksum
    guard = Guard.from_bundle(path, device=device, target_fpr=target_fpr)
    if sha256_file(manifest) != before:
        raise ArtefactError(f"bundle {path} changed while it was loaded; try again")
    try:
        guard.warmup(batch_sizes=tuple(warmup_sizes))
    except Exception as error:
        raise ArtefactError(f"bundle {path} fails on a forward pass: {error}") from error
    return ServedBundle(guard=guard, path=Path(path), sha256=before)


def check_compatible(served: Guard, new: Guard) -> None:
    """Refuse a Guard whose inputs differ from the served one's in shape, value range or resize
    rule and policy: queued requests were converted to the served spec, and clients rely on it."""
    old_spec, new_spec = served.input_spec, new.input_spec
    keys = ("channels", "height", "width", "value_range", "resize", *RESIZE_POLICY)
    old_view = {key: getattr(old_spec, key) for key in keys}
    new_view = {key: getattr(new_spec, key) for key in keys}
    if old_view != new_view:
        changed = ", ".join(
            f"{k} {old_view[k]} -> {new_view[k]}" for k in keys if old_view[k] != new_view[k]
        )
        raise ArtefactError(
            f"the new bundle takes other inputs ({changed}); a server keeps its input spec: "
            "start a new server for it"
        )
