"""A batch-scoring run: discover the inputs, resume from the output, let an engine score the rest.

An engine is only a function from the pending inputs to their results, batch by batch (in
process, over HTTP or on Ray); discovery, the output file and the summary are shared by all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from tqdm.auto import tqdm

from detector.errors import ConfigError
from service.batch.inputs import InputItem, InputLike, discover_inputs
from service.batch.writer import (
    BackgroundWriter,
    Format,
    OutputWriter,
    Row,
    output_columns,
    read_output,
    rewrite_output,
    row_key,
)

#: An engine turns the pending inputs into their results (``RESULT_KEYS`` or ``error``), in
#: order, one list per batch; the rows' identifying keys are added by :func:`run_scoring`.
Engine = Callable[[list[InputItem]], Iterator[list[Row]]]


class RunOptions(TypedDict, total=False):
    """The options every scoring entry point passes on to :func:`run_scoring`."""

    fmt: Format
    progress: bool
    retry_errors: bool


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


class _Tally:
    """Scored, error and flagged rows, counted as they are written."""

    def __init__(self) -> None:
        self.scored = self.errors = self.flagged = 0

    def add(self, rows: Sequence[Row]) -> None:
        for row in rows:
            failed = bool(row.get("error"))
            self.errors += failed
            self.scored += not failed
            self.flagged += (not failed) and bool(row.get("flagged"))


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
    if out.is_dir():
        raise ConfigError(
            f"--out {out} is a directory; name the output file, e.g. {out / 'results.jsonl'}"
        )
    items = discover_inputs(inputs)
    columns = output_columns(items)
    existing = read_output(out, fmt, columns)
    if retry_errors and any(row.get("error") for row in existing):
        existing = [row for row in existing if not row.get("error")]
        rewrite_output(out, fmt, columns, existing)
    wanted = {item.key for item in items}
    earlier = {row_key(row): row for row in existing if row_key(row) in wanted}
    pending = [item for item in items if item.key not in earlier]
    tally = _Tally()
    tally.add(list(earlier.values()))
    started = time.perf_counter()
    with (
        BackgroundWriter(OutputWriter(out, fmt, columns)) as writer,
        tqdm(
            total=len(pending), desc=description, unit="img", disable=not progress, leave=False
        ) as bar,
    ):
        done = _write_results(engine, pending, writer, tally, bar.update)
    return ScoringSummary(
        out=out,
        count=len(items),
        scored=tally.scored,
        errors=tally.errors,
        flagged=tally.flagged,
        resumed=len(earlier),
        new=done,
        seconds=time.perf_counter() - started,
    )


def _write_results(
    engine: Engine,
    pending: list[InputItem],
    writer: BackgroundWriter,
    tally: _Tally,
    advance: Callable[[int], object],
) -> int:
    """Run ``engine`` on ``pending`` and hand its rows to ``writer``; the number written."""
    done = 0
    if pending:
        for results in engine(pending):
            if done + len(results) > len(pending):
                raise RuntimeError("the scoring engine returned more results than inputs")
            rows = [
                {**item.ids(), **result}
                for item, result in zip(pending[done : done + len(results)], results, strict=True)
            ]
            writer.put(rows)
            tally.add(rows)
            done += len(rows)
            advance(len(rows))
    if done != len(pending):
        raise RuntimeError(f"the scoring engine returned {done} results for {len(pending)} inputs")
    return done
