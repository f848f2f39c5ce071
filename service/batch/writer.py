"""The output file of batch scoring: JSONL or CSV rows, appended batch by batch, read back to resume.

Every input gets one row: ``path`` (image files) or ``index`` (array and data-set items; with
``path`` naming the array as well when a run has more than one source), then the keys of a
``/v1/predict`` result (:data:`RESULT_KEYS`), or ``error``. Rows are written as whole lines and
flushed per batch, so an interruption can only cut the last line short.
"""

from __future__ import annotations

import csv
import io
import json
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from detector.artefacts import atomic_path
from detector.errors import ArtefactError
from service.batch.inputs import InputItem

Format = Literal["jsonl", "csv"]
Row = dict[str, Any]

#: The keys of a ``/v1/predict`` result that every scored row holds, in this order.
RESULT_KEYS = ("label", "class_name", "confidence", "flagged", "score", "threshold")
ID_KEYS = ("path", "index")


def output_columns(items: Sequence[InputItem]) -> list[str]:
    """CSV columns: the identifying keys the inputs use, the result keys, ``error``."""
    ids = [k for k in ID_KEYS if any(getattr(item, k) is not None for item in items)]
    return [*ids, *RESULT_KEYS, "error"]


def row_key(row: Row) -> tuple[str | None, int | None]:
    """The input a row belongs to, as :attr:`InputItem.key`."""
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


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str):
        return " ".join(value.splitlines())  # one row per line, always
    return value


def read_output(path: Path, fmt: Format, columns: list[str]) -> list[Row]:
    """The rows an earlier run wrote to ``path`` (none if it does not exist). Rows are written
    as whole lines, so only text after the last newline can be cut short by an interruption: it
    is removed from the file. Anything else that is not an output row is an error (the file is
    left as it is)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    *complete, partial = data.split(b"\n")  # text after the last newline was cut short
    start = 0
    if fmt == "csv" and complete:
        found = next(csv.reader([complete[0].decode("utf-8", "replace")]))
        if found != columns:
            raise ArtefactError(
                f"{path} has the columns {found}, this run writes {columns}; "
                "choose another --out, or delete the file to start over"
            )
        start = 1
    rows = [
        _parse_line(path, fmt, columns, number, raw)
        for number, raw in enumerate(complete[start:], start=start)
    ]
    if partial:
        _drop_cut_line(path, fmt, columns, data, partial, header_only=not complete)
    return rows


def _parse_line(path: Path, fmt: Format, columns: list[str], number: int, raw: bytes) -> Row:
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
    return row


def _drop_cut_line(
    path: Path, fmt: Format, columns: list[str], data: bytes, partial: bytes, *, header_only: bool
) -> None:
    """Truncate the text after the last newline when it looks like a row cut short."""
    header = _csv_line(columns).encode()
    looks_cut = (
        header.startswith(partial)
        if fmt == "csv" and header_only
        else partial.startswith(b"{") or fmt == "csv"
    )
    if not looks_cut:
        raise ArtefactError(f"{path} is not a {fmt} output of lapguard score; choose another --out")
    with open(path, "r+b") as handle:
        handle.truncate(len(data) - len(partial))


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
        """Append ``rows`` as whole lines and flush."""
        if self.fmt == "jsonl":
            text = "".join(json.dumps(row) + "\n" for row in rows)
        else:
            text = "".join(
                _csv_line([_csv_value(row.get(c)) for c in self.columns]) for row in rows
            )
        self._handle.write(text)
        self._handle.flush()

    def close(self) -> None:
        """Flush, fsync and close the file."""
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
        """Queue a batch of rows (raises an earlier write's error)."""
        self._raise()
        self._queue.put(rows)

    def close(self) -> None:
        """Write what was queued, close the file, raise a write error if there was one."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.writer.close()
        self._raise()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_output(path: Path, fmt: Format, columns: list[str], rows: Sequence[Row]) -> None:
    """Replace the output file by ``rows``, atomically."""
    with atomic_path(path) as tmp, OutputWriter(tmp, fmt, columns) as writer:
        writer.write(rows)
