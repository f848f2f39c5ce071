"""Batch scoring (``lapguard score``): many images through one Guard into a JSONL or CSV file
that a re-run resumes, in process, on a running server or on a Ray cluster.

- :mod:`service.batch.inputs`: discovering the inputs, and the one payload loader;
- :mod:`service.batch.writer`: the output file (rows, resume, CSV/JSONL);
- :mod:`service.batch.runner`: a run (resume, engine, summary), shared by every engine;
- :mod:`service.batch.local`, :mod:`service.batch.http`, :mod:`service.batch.ray`: the engines;
- :mod:`service.batch.command`: ``lapguard score``'s request, dispatched to an engine.

Every input gets one output row: ``path`` (image files) or ``index`` (array and data-set items),
then the keys of a ``/v1/predict`` result, or ``error`` for an input that could not be scored;
such inputs are counted and never stop the run. ``score`` is higher for more abnormal inputs and
``flagged = score > threshold``.
"""

from service.batch.command import ScoreRequest, score
from service.batch.inputs import InMemoryInput, dataset_input, discover_inputs
from service.batch.local import score_inputs
from service.batch.runner import Engine, ScoringSummary, run_scoring
from service.batch.writer import RESULT_KEYS, read_output

__all__ = [
    "RESULT_KEYS",
    "Engine",
    "InMemoryInput",
    "ScoreRequest",
    "ScoringSummary",
    "dataset_input",
    "discover_inputs",
    "read_output",
    "run_scoring",
    "score",
    "score_inputs",
]
