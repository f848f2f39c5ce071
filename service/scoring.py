"""Batch scoring: many images through one Guard into a JSONL or CSV file that a re-run resumes.

Inputs are image files, folders (searched recursively for image extensions), ``.npy``/``.npz``
arrays (a stack of images along the first axis: ``[N, H, W]``, ``[N, C, H, W]`` or
``[N, H, W, C]``, uint8 or floats in the value range) and in-memory arrays or data sets (the CLI
hands over a torchvision data set; this module never imports ``training``).

Every input gets one output row: ``path`` (image files) or ``index`` (array and data-set items;
with ``path`` naming the array as well when a run has more than one source), then the keys of a
``/v1/predict`` result (``label``, ``class_name``, ``confidence``, ``flagged``, ``score``,
``threshold``), or ``error`` for an input that could not be scored (unreadable or corrupt file,
wrong shape); such inputs are counted and never stop the run. ``score`` is higher for more
abnormal inputs and ``flagged = score > threshold``.

Rows are appended and flushed batch by batch, in input order. A re-run reads the output, drops a
truncated last line and scores only the inputs that have no row yet. Locally, DataLoader worker
processes read, decode and prepare the next batches while the main process runs the network.

Input discovery, the output file and the summary here are the ONE implementation that the HTTP
client (:mod:`service.client`) and the Ray engine (:mod:`service.ray_engine`) share: an engine
is only a function from the pending inputs to their results, batch by batch.
"""

from __future__ import annotations

import csv
import io
import json
import math
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from detector.errors import ArtefactError, ConfigError, DataNotFoundError, InputError, LapguardError
from detector.guard import Guard, GuardResult
from detector.images import DEFAULT_MAX_PIXELS, decode_image

Format = Literal["jsonl", "csv"]
Row = dict[str, Any]
#: An engine turns the pending inputs into their results (``RESULT_KEYS`` or ``error``), in
#: order, one list per batch; the rows' identifying keys are added by :func:`run_scoring`.
Engine = Callable[[list["InputItem"]], Iterator[list[Row]]]

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
ARRAY_EXTENSIONS = frozenset({".npy", ".npz"})
#: The keys of a ``/v1/predict`` result that every scored row holds, in this order.
RESULT_KEYS = ("label", "class_name", "confidence", "flagged", "score", "threshold")
ID_KEYS = ("path", "index")
#: Array names tried, in order, in an ``.npz`` holding more than one array.
NPZ_KEYS = ("images", "x", "arr_0")


# ---- inputs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class InMemoryInput:
    """An array (a stack of images along axis 0) or a data set whose items are an image or an
    ``(image, target)`` pair (image: array or tensor, HW/CHW/HWC), named for the output."""

    name: str
    data: np.ndarray | Dataset


class ArraySource:
    """Images by position in an array (memory-mapped for ``.npy``) or a data set."""

    def __init__(self, data: np.ndarray | Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def image(self, index: int) -> np.ndarray:
        item = self.data[index]
        if isinstance(item, (tuple, list)):  # (image, target) from a torchvision data set
            item = item[0]
        if isinstance(item, torch.Tensor):
            return item.numpy()
        return np.asarray(item)


@dataclass(frozen=True)
class InputItem:
    """One input: an image file (``path``), an item of an array or data set (``index``, with the
    array's ``path`` when the run has several sources), or an input already known to be unusable
    (``problem``, e.g. an array file that cannot be read)."""

    path: str | None = None
    index: int | None = None
    source: ArraySource | None = field(default=None, compare=False, repr=False)
    problem: str | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple[str | None, int | None]:
        return (self.path, self.index)

    def ids(self) -> Row:
        """The identifying keys of this input's output row."""
        return {k: v for k, v in (("path", self.path), ("index", self.index)) if v is not None}


InputLike = str | Path | np.ndarray | Dataset | InMemoryInput


def discover_inputs(inputs: Sequence[InputLike]) -> list[InputItem]:
    """The inputs, in order: folders expanded (recursively, sorted, image extensions only),
    arrays and data sets expanded by position, duplicates dropped. A path that does not exist
    is a :class:`DataNotFoundError` (nothing is scored); a file that cannot be read or decoded
    is not found out here but when it is scored."""
    entries: list[tuple[str, str | None, ArraySource | None, str | None]] = []  # kind, path, ...
    for number, given in enumerate(inputs):
        if isinstance(given, InMemoryInput):
            entries.append(("array", given.name, ArraySource(given.data), None))
        elif isinstance(given, (np.ndarray, Dataset)):
            entries.append(("array", f"<input {number}>", ArraySource(given), None))
        else:
            path = Path(given)
            if path.is_dir():
                found = sorted(
                    p
                    for p in path.rglob("*")
                    if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                )
                entries.extend(("file", str(p), None, None) for p in found)
            elif path.is_file() and path.suffix.lower() in ARRAY_EXTENSIONS:
                try:
                    entries.append(("array", str(path), ArraySource(open_array(path)), None))
                except InputError as error:
                    entries.append(("array", str(path), None, describe_error(error)))
            elif path.exists():
                entries.append(("file", str(path), None, None))  # any other file: tried as an image
            else:
                raise DataNotFoundError(f"input {str(given)!r} does not exist")
    several = len(entries) > 1
    items: list[InputItem] = []
    seen: set[tuple[str | None, int | None]] = set()
    for kind, name, source, problem in entries:
        if kind == "file":
            batch = [InputItem(path=name)]
        elif source is None:  # an array that cannot be used: one row for the file
            batch = [InputItem(path=name, problem=problem)]
        else:
            label = name if several else None
            batch = [InputItem(path=label, index=i, source=source) for i in range(len(source))]
        for item in batch:
            if item.key not in seen:
                seen.add(item.key)
                items.append(item)
    if not items:
        raise DataNotFoundError(
            "no inputs to score: give image files, folders holding images "
            f"({', '.join(sorted(IMAGE_EXTENSIONS))}), .npy/.npz arrays or a data set"
        )
    return items


def open_array(path: Path) -> np.ndarray:
    """A stack of images from ``.npy`` (memory-mapped) or ``.npz`` (its only array, else the
    first of ``images``, ``x``, ``arr_0``); :class:`InputError` when it is not one."""
    try:
        if path.suffix.lower() == ".npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            with np.load(path, allow_pickle=False) as archive:
                names = list(archive.files)
                name = (
                    names[0] if len(names) == 1 else next((k for k in NPZ_KEYS if k in names), None)
                )
                if name is None:
                    raise InputError(
                        f"{path} holds arrays {names}; keep one array, or name it one of {list(NPZ_KEYS)}"
                    )
                array = archive[name]
    except (OSError, ValueError, EOFError) as error:  # not an array file, or pickled objects
        raise InputError(f"cannot read {path} as a numpy array: {error}") from error
    if array.ndim not in (3, 4) or not (
        array.dtype == np.uint8 or np.issubdtype(array.dtype, np.floating)
    ):
        raise InputError(
            f"{path} is a {array.dtype} array of shape {list(array.shape)}; expected a stack of "
            "images [N, H, W], [N, C, H, W] or [N, H, W, C] of uint8 or floats"
        )
    return array


def load_payload(item: InputItem) -> bytes | np.ndarray:
    """What an input holds: an image file's encoded bytes, or an array item's pixels."""
    if item.problem is not None:
        raise InputError(item.problem)
    if item.source is not None and item.index is not None:
        return item.source.image(item.index)
    if item.path is None:
        raise InputError("an input with neither a path nor an index")
    return Path(item.path).read_bytes()


def describe_error(error: BaseException) -> str:
    """One line saying why an input could not be scored."""
    if isinstance(error, LapguardError):
        text = str(error)
    elif isinstance(error, OSError) and error.strerror:
        text = f"cannot read the file: {error.strerror}"
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


# ---- preparing and scoring (shared by the local and the Ray engine) --------------------------
@dataclass(frozen=True)
class Unusable:
    """Marks an input that could not be read, decoded or converted, and why."""

    reason: str


@dataclass
class PreparedBatch:
    """The usable inputs of a batch stacked ``[n, C, H, W]``, and per input why it is unusable
    (None where it is usable)."""

    images: torch.Tensor | None
    problems: list[str | None]

    def pin_memory(self) -> PreparedBatch:
        """Page-locked images (DataLoader ``pin_memory``: faster copies to the GPU)."""
        images = self.images.pin_memory() if self.images is not None else None
        return PreparedBatch(images, self.problems)


def prepare_payload(
    prepare: Callable[[list[np.ndarray]], torch.Tensor],
    payload: bytes | np.ndarray | Unusable,
    *,
    channels: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> torch.Tensor | Unusable:
    """Decode (bytes) and convert one input to the input spec with ``prepare`` (a Guard's);
    any failure comes back as :class:`Unusable` instead of being raised."""
    if isinstance(payload, Unusable):
        return payload
    try:
        if isinstance(payload, bytes):
            image = decode_image(payload, max_pixels=max_pixels, keep_alpha=channels == 4)
        else:
            image = payload
        return prepare([image])[0]
    except Exception as error:  # one bad input never stops the run: it gets an error row
        return Unusable(describe_error(error))


def collate(prepared: Sequence[torch.Tensor | Unusable]) -> PreparedBatch:
    """Stack the usable inputs; keep each unusable one's reason in its place."""
    usable = [p for p in prepared if isinstance(p, torch.Tensor)]
    return PreparedBatch(
        images=torch.stack(usable) if usable else None,
        problems=[p.reason if isinstance(p, Unusable) else None for p in prepared],
    )


def result_rows(result: GuardResult) -> list[Row]:
    """Every image of a Guard result as the keys of a ``/v1/predict`` result (converted to
    Python values column by column, not element by element)."""
    threshold = float(result.threshold)
    return [
        {
            "label": label,
            "class_name": name,
            "confidence": confidence,
            "flagged": flagged,
            "score": score,
            "threshold": threshold,
        }
        for label, name, confidence, flagged, score in zip(
            result.labels.tolist(),
            result.class_names,
            result.confidences.tolist(),
            result.flagged.tolist(),
            result.scores.tolist(),
            strict=True,
        )
    ]


def score_batch(guard: Guard, batch: PreparedBatch) -> list[Row]:
    """The results of a prepared batch, in input order (``{"error": ...}`` for unusable ones)."""
    if batch.images is None:
        return [{"error": problem} for problem in batch.problems]
    scored = iter(result_rows(guard.predict(batch.images)))
    return [
        {"error": problem} if problem is not None else next(scored) for problem in batch.problems
    ]


class PreparingDataset(Dataset):
    """Inputs read, decoded and converted to the input spec, one per item (in worker processes);
    an input that fails is returned as :class:`Unusable`, never raised."""

    def __init__(
        self,
        items: Sequence[InputItem],
        prepare: Callable[[list[np.ndarray]], torch.Tensor],
        *,
        channels: int,
    ) -> None:
        self.items = list(items)
        self.prepare = prepare
        self.channels = channels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor | Unusable:
        return prepare_payload(self.prepare, _payload(self.items[i]), channels=self.channels)


def _array_chunk(guard: Guard, chunk: Sequence[InputItem]) -> PreparedBatch | None:
    """A batch of items of one in-memory array, sliced and converted in one vectorized step; None
    when the items are not such a batch or any of them is unusable (the per-item path then
    gives each bad input its own error row)."""
    sources = {id(item.source) for item in chunk}
    first = chunk[0].source
    if len(sources) != 1 or first is None or not isinstance(first.data, np.ndarray):
        return None
    if any(item.index is None or item.problem is not None for item in chunk):
        return None
    try:
        rows = np.array([item.index for item in chunk], dtype=np.int64)
        images = guard.prepare(np.asarray(first.data[rows]))
    except Exception:  # noqa: BLE001 - any failure: let the per-item path name the input at fault
        return None
    return PreparedBatch(images=images, problems=[None] * len(chunk))


def local_results(
    guard: Guard, pending: list[InputItem], *, batch_size: int, num_workers: int
) -> Iterator[list[Row]]:
    """The local engine. Items of in-memory arrays are sliced and converted a batch at a time in
    this process, with every torch thread; files (and anything unusual) are read, decoded and
    converted by ``num_workers`` processes ahead of the network, which meanwhile runs on at most
    ``cpu_count - num_workers`` torch threads (restored afterwards), so that loaders and inference
    do not fight over the cores."""
    if all(
        item.source is not None and isinstance(item.source.data, np.ndarray) for item in pending
    ):
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            batch = _array_chunk(guard, chunk)
            if batch is None:
                batch = collate(
                    [
                        prepare_payload(
                            guard.prepare, _payload(item), channels=guard.input_spec.channels
                        )
                        for item in chunk
                    ]
                )
            yield score_batch(guard, batch)
        return
    workers = min(max(num_workers, 0), math.ceil(len(pending) / batch_size))
    # Workers are forked: they inherit the Guard (only its CPU-side `prepare` runs there), so
    # nothing is pickled. Where fork does not exist, the main process prepares.
    if workers and "fork" not in multiprocessing.get_all_start_methods():
        workers = 0
    dataset = PreparingDataset(pending, guard.prepare, channels=guard.input_spec.channels)
    threads = torch.get_num_threads()
    budget = max(1, (os.cpu_count() or 1) - workers)  # leave the loaders their cores
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context="fork" if workers else None,
        pin_memory=guard.device.type == "cuda",
        prefetch_factor=4 if workers else None,
    )
    try:
        torch.set_num_threads(min(threads, budget))
        for batch in loader:
            yield score_batch(guard, batch)
    finally:
        torch.set_num_threads(threads)


def _payload(item: InputItem) -> bytes | np.ndarray | Unusable:
    try:
        return load_payload(item)
    except Exception as error:  # noqa: BLE001 - unreadable input: an error row, not a failed run
        return Unusable(describe_error(error))


# ---- the output file -------------------------------------------------------------------------
def output_columns(items: Sequence[InputItem]) -> list[str]:
    """CSV columns: the identifying keys the inputs use, the result keys, ``error``."""
    ids = [k for k in ID_KEYS if any(getattr(item, k) is not None for item in items)]
    return [*ids, *RESULT_KEYS, "error"]


def row_key(row: Row) -> tuple[str | None, int | None]:
    index = row.get("index")
    return (row.get("path") or None, int(index) if index not in (None, "") else None)


def _csv_line(values: Sequence[Any]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    return buffer.getvalue()


def _csv_row(line: str, columns: list[str]) -> Row:
    values = next(csv.reader([line]))
    if len(values) != len(columns):
        raise ValueError(f"{len(values)} fields, the header has {len(columns)}")
    row: Row = dict(zip(columns, values, strict=True))
    row["flagged"] = row.get("flagged") == "True"
    return row


def read_output(path: Path, fmt: Format, columns: list[str]) -> list[Row]:
    """The rows an earlier run wrote to ``path`` (none if it does not exist). Rows are written
    as whole lines, so only text after the last newline can be cut short by an interruption: it
    is removed from the file. Anything else that is not an output row is an error (the file is
    left as it is)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    *complete, partial = data.split(b"\n")  # text after the last newline was cut short
    header = _csv_line(columns).encode()
    start = 0
    if fmt == "csv" and complete:
        found = next(csv.reader([complete[0].decode("utf-8", "replace")]))
        if found != columns:
            raise ArtefactError(
                f"{path} has the columns {found}, this run writes {columns}; "
                "choose another --out, or delete the file to start over"
            )
        start = 1
    rows: list[Row] = []
    for number, raw in enumerate(complete[start:], start=start):
        try:
            text = raw.decode("utf-8")
            row = json.loads(text) if fmt == "jsonl" else _csv_row(text, columns)
            if not isinstance(row, dict) or not any(k in row for k in ID_KEYS):
                raise ValueError("not an output row")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ArtefactError(
                f"{path} line {number + 1} is not a {fmt} output row ({error}); "
                "remove the line, or choose another --out"
            ) from error
        rows.append(row)
    if partial:
        looks_cut = (
            header.startswith(partial)
            if fmt == "csv" and not complete
            else partial.startswith(b"{") or fmt == "csv"
        )
        if not looks_cut:
            raise ArtefactError(
                f"{path} is not a {fmt} output of lapguard score; choose another --out"
            )
        with open(path, "r+b") as handle:
            handle.truncate(len(data) - len(partial))
    return rows


class OutputWriter:
    """Appends rows to a JSONL or CSV file (header first when the file is new), flushed per batch."""

    def __init__(self, path: Path, fmt: Format, columns: list[str]) -> None:
        self.path, self.fmt, self.columns = path, fmt, columns
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 (closed by close())
        if fmt == "csv" and self._handle.tell() == 0:
            self._handle.write(_csv_line(columns))
            self._handle.flush()

    def write(self, rows: Sequence[Row]) -> None:
        if self.fmt == "jsonl":
            text = "".join(json.dumps(row) + "\n" for row in rows)
        else:
            text = "".join(
                _csv_line([_csv_value(row.get(c)) for c in self.columns]) for row in rows
            )
        self._handle.write(text)
        self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BackgroundWriter:
    """Hands batches of rows to an :class:`OutputWriter` on a thread, so that serializing and
    writing one batch overlaps the next batch's inference (torch releases the GIL). ``close``
    writes every batch handed over, then closes the file; a write error is raised by the next
    ``put`` or by ``close``."""

    def __init__(self, writer: OutputWriter, *, depth: int = 4) -> None:
        self.writer = writer
        self._queue: queue.Queue[list[Row] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lapguard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (rows := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.writer.write(rows)
                except BaseException as error:  # raised in the caller's thread
                    self._error = error

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, rows: list[Row]) -> None:
        self._raise()
        self._queue.put(rows)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.writer.close()
        self._raise()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str):
        return " ".join(value.splitlines())  # one row per line, always
    return value


def _rewrite(path: Path, fmt: Format, columns: list[str], rows: Sequence[Row]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with OutputWriter(tmp, fmt, columns) as writer:
        writer.write(rows)
    tmp.replace(path)


# ---- the run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoringSummary:
    """What a scoring run did. Counts cover every input of the run (rows written by an earlier,
    interrupted run included); ``seconds`` and ``throughput`` cover this run's work only."""

    out: Path
    count: int  # inputs, one output row each
    scored: int  # rows with a prediction
    errors: int  # rows with an error
    flagged: int  # scored rows flagged abnormal
    resumed: int  # inputs that already had a row (skipped)
    new: int  # rows written by this run
    seconds: float

    @property
    def flag_rate(self) -> float:
        return self.flagged / self.scored if self.scored else 0.0

    @property
    def throughput(self) -> float:
        """Inputs per second processed by this run."""
        return self.new / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "count": self.count,
            "scored": self.scored,
            "errors": self.errors,
            "flagged": self.flagged,
            "flag_rate": self.flag_rate,
            "resumed": self.resumed,
            "new": self.new,
            "seconds": self.seconds,
            "throughput": self.throughput,
        }

    def __str__(self) -> str:
        resumed = f" ({self.resumed} already there, skipped)" if self.resumed else ""
        return (
            f"{self.count} inputs -> {self.out}{resumed}\n"
            f"  scored {self.scored}, errors {self.errors}, flagged {self.flagged} "
            f"(flag rate {self.flag_rate:.2%})\n"
            f"  {self.new} scored in {self.seconds:.1f} s: {self.throughput:.1f} images/s"
        )


def run_scoring(
    inputs: Sequence[InputLike],
    out_path: str | Path,
    engine: Engine,
    *,
    fmt: Format = "jsonl",
    progress: bool = True,
    retry_errors: bool = False,
    description: str = "score",
) -> ScoringSummary:
    """Discover the inputs, skip those the output already holds, let ``engine`` score the rest
    and append its rows batch by batch. ``retry_errors`` first removes error rows from the
    output, so that those inputs are scored again."""
    if fmt not in ("jsonl", "csv"):
        raise ConfigError(f"output format must be 'jsonl' or 'csv', got {fmt!r}")
    out = Path(out_path)
    items = discover_inputs(inputs)
    columns = output_columns(items)
    existing = read_output(out, fmt, columns)
    if retry_errors and any(row.get("error") for row in existing):
        existing = [row for row in existing if not row.get("error")]
        _rewrite(out, fmt, columns, existing)
    wanted = {item.key for item in items}
    earlier = {row_key(row): row for row in existing if row_key(row) in wanted}
    pending = [item for item in items if item.key not in earlier]
    counts = {"scored": 0, "errors": 0, "flagged": 0}

    def tally(rows: Sequence[Row]) -> None:
        for row in rows:
            failed = bool(row.get("error"))
            counts["errors"] += failed
            counts["scored"] += not failed
            counts["flagged"] += (not failed) and bool(row.get("flagged"))

    tally(list(earlier.values()))
    started = time.perf_counter()
    done = 0
    with (
        BackgroundWriter(OutputWriter(out, fmt, columns)) as writer,
        tqdm(
            total=len(pending), desc=description, unit="img", disable=not progress, leave=False
        ) as bar,
    ):
        if pending:
            for results in engine(pending):
                if done + len(results) > len(pending):
                    raise RuntimeError("the scoring engine returned more results than inputs")
                rows = [
                    {**item.ids(), **result}
                    for item, result in zip(
                        pending[done : done + len(results)], results, strict=True
                    )
                ]
                writer.put(rows)
                tally(rows)
                done += len(rows)
                bar.update(len(rows))
    if done != len(pending):
        raise RuntimeError(f"the scoring engine returned {done} results for {len(pending)} inputs")
    return ScoringSummary(
        out=out,
        count=len(items),
        resumed=len(earlier),
        new=done,
        seconds=time.perf_counter() - started,
        **counts,
    )


def score_inputs(
    guard: Guard,
    inputs: Sequence[InputLike],
    out_path: str | Path,
    *,
    fmt: Format = "jsonl",
    batch_size: int = 256,
    num_workers: int = 2,
    progress: bool = True,
    retry_errors: bool = False,
) -> ScoringSummary:
    """Score ``inputs`` with ``guard`` in this process into ``out_path`` (JSONL or CSV), resuming
    an interrupted run; ``num_workers`` processes read and prepare batches ahead of the network."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}")

    def engine(pending: list[InputItem]) -> Iterator[list[Row]]:
        return local_results(guard, pending, batch_size=batch_size, num_workers=num_workers)

    return run_scoring(
        inputs, out_path, engine, fmt=fmt, progress=progress, retry_errors=retry_errors
    )
