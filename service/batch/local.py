"""In-process batch scoring (``lapguard score --bundle``): one Guard, DataLoader workers ahead.

Items of in-memory arrays are sliced and converted a batch at a time in this process; files
(and anything unusual) are read, decoded and converted by forked worker processes while the
main process runs the network.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from detector.errors import ConfigError
from detector.guard import Guard
from service.batch.batches import (
    Prepare,
    PreparedBatch,
    collate,
    prepare_batch,
    prepare_payload,
    score_batch,
)
from service.batch.inputs import InputItem, InputLike, Unusable, read_payload
from service.batch.runner import RunOptions, ScoringSummary, run_scoring
from service.batch.writer import Row

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only


def score_inputs(
    guard: Guard,
    inputs: Sequence[InputLike],
    out_path: str | Path,
    *,
    batch_size: int = 256,
    num_workers: int = 2,
    **options: Unpack[RunOptions],
) -> ScoringSummary:
    """Score ``inputs`` with ``guard`` in this process into ``out_path`` (JSONL or CSV, see
    :func:`~service.batch.runner.run_scoring` for ``options``), resuming an interrupted run;
    ``num_workers`` processes read and prepare batches ahead of the network."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}")

    def engine(pending: list[InputItem]) -> Iterator[list[Row]]:
        return local_results(guard, pending, batch_size=batch_size, num_workers=num_workers)

    return run_scoring(inputs, out_path, engine, **options)


class PreparingDataset(Dataset):
    """Inputs read, decoded and converted to the input spec, one per item (in worker processes);
    an input that fails is returned as :class:`Unusable`, never raised."""

    def __init__(self, items: Sequence[InputItem], prepare: Prepare, *, channels: int) -> None:
        self.items = list(items)
        self.prepare = prepare
        self.channels = channels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor | Unusable:
        return prepare_payload(self.prepare, read_payload(self.items[i]), channels=self.channels)


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
                batch = prepare_batch(guard, [read_payload(item) for item in chunk])
            yield score_batch(guard, batch)
        return
    yield from _loader_results(guard, pending, batch_size=batch_size, num_workers=num_workers)


def _loader_results(
    guard: Guard, pending: list[InputItem], *, batch_size: int, num_workers: int
) -> Iterator[list[Row]]:
    """Results of batches prepared by DataLoader workers (see :func:`local_results`)."""
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
