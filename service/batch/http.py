"""Batch scoring against a running server (``lapguard score --url``).

The same inputs, output rows, resume and summary as in-process scoring
(:mod:`service.batch.runner` does all of that); only the engine differs: image files are sent as they are to
``POST /v1/predict`` (multipart ``files``), array and data-set items as FP32 tensors to the
KServe v2 ``infer`` route (binary tensor extension), so floats are never rounded to 8 bits.

At most ``concurrency`` requests are in flight (an httpx AsyncClient and a semaphore). 429, 502,
503 and 504 answers and connection errors are retried with exponential backoff, honouring
``Retry-After``; an input still failing after the retries gets an ``error`` row (re-run with
``retry_errors`` to try those again). A request refused for its content (400, 413, 415, 422,
500) is split in halves until the input at fault is alone, and only that one gets the error.
A refused API key (401), a client refused as a query attack (403) or an unknown route (404)
stops the run, with what to do: no further row could succeed.
Error answers are read in their route's shape: ``{"error": {"code", "message"}}`` under
``/v1``, the Open Inference Protocol's ``{"error": "message"}`` under ``/v2``.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx
import numpy as np

from detector.errors import ConfigError, LapguardError
from detector.preprocessing import scale_uint8
from service.batch.inputs import InputItem, InputLike, Payload, Unusable, read_payload
from service.batch.runner import RunOptions, ScoringSummary, run_scoring
from service.batch.writer import RESULT_KEYS, Row
from service.inference_protocol import binary_request, json_outputs

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only

RETRY_STATUSES = frozenset({429, 502, 503, 504})
FATAL_STATUSES = frozenset({401, 403, 404})
FATAL_HINTS = {  # what to do, by status (an inference route answers 403 only to a query attack)
    401: "; pass --api-key (or set LAPGUARD_API_KEY)",
    403: (
        "; the rows scored so far are kept: re-run the same command after the cool-down to go on, "
        "or ask the server's operator for LAPGUARD_QUERY_ATTACK_ACTION=flag, which answers "
        "near-duplicate images instead of refusing them"
    ),
}
V2_OUTPUTS = ("probabilities", "label", "flagged", "score")


@dataclass(frozen=True)
class ServedModel:
    """What the server says it serves (``GET /v1/model``)."""

    name: str
    class_names: list[str]
    value_range: tuple[float, float]


def score_url(
    url: str,
    inputs: Sequence[InputLike],
    out_path: str | Path,
    *,
    batch_size: int = 32,
    concurrency: int = 4,
    retries: int = 5,
    timeout: float = 60.0,
    api_key: str | None = None,
    **options: Unpack[RunOptions],
) -> ScoringSummary:
    """Score ``inputs`` on the server at ``url`` into ``out_path`` (``options``: see
    :func:`~service.batch.runner.run_scoring`); ``batch_size`` images per request, at most
    ``concurrency`` requests at a time; resumes an interrupted run."""
    if batch_size < 1 or concurrency < 1 or retries < 0 or timeout <= 0:
        raise ConfigError(
            "batch size and concurrency must be at least 1, retries at least 0 and the timeout positive"
        )
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {url!r}")

    def engine(pending: list[InputItem]) -> Iterator[list[Row]]:
        client = HttpScorer(
            url.rstrip("/"),
            concurrency=concurrency,
            retries=retries,
            timeout=timeout,
            api_key=api_key,
        )
        return drive_results(client.results(pending, batch_size=batch_size))

    return run_scoring(inputs, out_path, engine, description=f"score {url}", **options)


class HttpScorer:
    """Scores groups of inputs over HTTP with bounded concurrency, retries and bisection."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 4,
        retries: int = 5,
        timeout: float = 60.0,
        api_key: str | None = None,
        backoff_s: float = 0.5,
        max_delay_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.concurrency = concurrency
        self.retries = retries
        self.timeout = timeout
        self.headers = {"X-API-Key": api_key} if api_key else {}
        self.backoff_s = backoff_s
        self.max_delay_s = max_delay_s
        self.transport = transport  # None: the network (tests pass an httpx.MockTransport)
        self.model: ServedModel | None = None
        self._http: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    async def results(
        self, pending: list[InputItem], *, batch_size: int
    ) -> AsyncGenerator[list[Row], None]:
        """One list of results per group of ``batch_size`` inputs, in input order; up to
        ``2 * concurrency`` groups are being worked on while the first is awaited."""
        limits = httpx.Limits(
            max_connections=self.concurrency, max_keepalive_connections=self.concurrency
        )
        async with httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=self.timeout,
            limits=limits,
            transport=self.transport,
        ) as http:
            self._http, self._slots = http, asyncio.Semaphore(self.concurrency)
            self.model = await self._describe()
            window: deque[asyncio.Task[list[Row]]] = deque()
            try:
                for start in range(0, len(pending), batch_size):
                    group = pending[start : start + batch_size]
                    window.append(asyncio.create_task(self.score(group)))
                    if len(window) >= 2 * self.concurrency:
                        yield await window.popleft()
                while window:
                    yield await window.popleft()
            finally:
                for task in window:
                    task.cancel()
                await asyncio.gather(*window, return_exceptions=True)

    # ---- one group -------------------------------------------------------------------------------
    async def score(self, group: Sequence[InputItem]) -> list[Row]:
        """Results for ``group``: files in one multipart request, array items in one v2 request
        per image shape."""
        payloads = await asyncio.to_thread(_load_all, group, self._served.value_range)
        results: list[Row | None] = [None] * len(group)
        files: list[tuple[int, bytes]] = []
        by_shape: dict[tuple[int, ...], list[tuple[int, np.ndarray]]] = {}
        for i, payload in enumerate(payloads):
            if isinstance(payload, Unusable):
                results[i] = {"error": payload.reason}
            elif isinstance(payload, bytes):
                files.append((i, payload))
            else:
                by_shape.setdefault(payload.shape, []).append((i, payload))
        parts: list[Awaitable[list[Row]]] = []
        targets: list[list[int]] = []
        if files:
            names = [Path(group[i].path or f"input-{i}").name for i, _ in files]
            parts.append(self._files([blob for _, blob in files], names))
            targets.append([i for i, _ in files])
        for same_shape in by_shape.values():
            parts.append(self._tensors(np.stack([array for _, array in same_shape])))
            targets.append([i for i, _ in same_shape])
        for positions, rows in zip(targets, await asyncio.gather(*parts), strict=True):
            for i, row in zip(positions, rows, strict=True):
                results[i] = row
        return [row if row is not None else {"error": "no result"} for row in results]

    async def _files(self, blobs: list[bytes], names: list[str]) -> list[Row]:
        files = [
            ("files", (name, blob, "application/octet-stream"))
            for name, blob in zip(names, blobs, strict=True)
        ]
        outcome = await self._request(lambda: self._client.post("/v1/predict", files=files))
        if isinstance(outcome, str):
            return [{"error": outcome}] * len(blobs)
        if outcome.status_code == 200:
            results = outcome.json()["results"]
            return [{k: r[k] for k in RESULT_KEYS} for r in results]
        if len(blobs) > 1:  # find the input at fault
            half = len(blobs) // 2
            first, second = await asyncio.gather(
                self._files(blobs[:half], names[:half]), self._files(blobs[half:], names[half:])
            )
            return first + second
        return [{"error": _refusal(outcome)}]

    async def _tensors(self, batch: np.ndarray) -> list[Row]:
        model = self._served
        body, headers = binary_request("input", batch, "FP32", outputs=V2_OUTPUTS)

        def send() -> Awaitable[httpx.Response]:
            return self._client.post(
                f"/v2/models/{quote(model.name, safe='')}/infer", content=body, headers=headers
            )

        outcome = await self._request(send)
        if isinstance(outcome, str):
            return [{"error": outcome}] * len(batch)
        if outcome.status_code == 200:
            return _v2_rows(outcome.json(), model)
        if len(batch) > 1:
            half = len(batch) // 2
            first, second = await asyncio.gather(
                self._tensors(batch[:half]), self._tensors(batch[half:])
            )
            return first + second
        return [{"error": _refusal(outcome)}]

    # ---- requests --------------------------------------------------------------------------------
    async def _request(self, send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response | str:
        """The answer to a request once it is not a retryable failure, or why it was given up.
        401/403/404 raise (:data:`FATAL_HINTS`): the run cannot go on."""
        reason = ""
        for attempt in range(self.retries + 1):
            delay = self._backoff(attempt)
            try:
                async with self._semaphore:
                    response = await send()
            except httpx.TransportError as error:  # connection refused/reset, timeouts
                reason = f"connection error: {type(error).__name__}: {error}".rstrip(": ")
            else:
                if response.status_code in FATAL_STATUSES:
                    raise LapguardError(
                        f"{self.url} answered {response.status_code} to {response.request.url.path}: "
                        f"{_message(response)}{FATAL_HINTS.get(response.status_code, '')}"
                    )
                if response.status_code not in RETRY_STATUSES:
                    return response
                reason = f"HTTP {response.status_code}: {_message(response)}"
                delay = _retry_after(response, self.max_delay_s) or delay
            if attempt < self.retries:
                await asyncio.sleep(delay)
        attempts = self.retries + 1
        return f"{reason} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})"

    def _backoff(self, attempt: int) -> float:
        return min(self.max_delay_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)

    async def _describe(self) -> ServedModel:
        outcome = await self._request(lambda: self._client.get("/v1/model"))
        if isinstance(outcome, str):
            raise LapguardError(f"cannot reach the server at {self.url}: {outcome}")
        if outcome.status_code != 200:
            raise LapguardError(
                f"{self.url}/v1/model answered {outcome.status_code}: {_message(outcome)}; is it a lapguard server?"
            )
        summary = outcome.json()
        low, high = summary["input_spec"].get("value_range", (0.0, 1.0))
        return ServedModel(
            name=summary["name"],
            class_names=list(summary["class_names"]),
            value_range=(float(low), float(high)),
        )

    @property
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("HttpScorer.results() opens the connection")
        return self._http

    @property
    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            raise RuntimeError("HttpScorer.results() opens the connection")
        return self._slots

    @property
    def _served(self) -> ServedModel:
        if self.model is None:
            raise RuntimeError("HttpScorer.results() reads the served model first")
        return self.model


# ---- payloads and answers ----------------------------------------------------------------------
def _load_all(
    group: Sequence[InputItem], value_range: tuple[float, float]
) -> list[Payload | Unusable]:
    """Per input: a file's bytes, an array item as float32 in the value range (CHW or HWC; HW
    gets a channel axis; uint8 scaled by :func:`detector.preprocessing.scale_uint8`, as the
    Guard does), or why it cannot be read."""
    return [_for_the_server(read_payload(item), value_range) for item in group]


def _for_the_server(
    payload: Payload | Unusable, value_range: tuple[float, float]
) -> Payload | Unusable:
    if isinstance(payload, (bytes, Unusable)):
        return payload
    image = np.asarray(payload)
    if image.dtype == np.uint8:
        image = scale_uint8(image, value_range).numpy()
    return image[None] if image.ndim == 2 else image


def _v2_rows(answer: dict, model: ServedModel) -> list[Row]:
    outputs = json_outputs(answer)
    probabilities = outputs["probabilities"].astype(np.float32)
    labels = outputs["label"].astype(np.int64)
    threshold = float(answer.get("parameters", {})["threshold"])
    return [
        {
            "label": int(labels[i]),
            "class_name": model.class_names[int(labels[i])],
            "confidence": float(probabilities[i].max()),
            "flagged": bool(outputs["flagged"][i]),
            "score": float(np.float32(outputs["score"][i])),
            "threshold": threshold,
        }
        for i in range(len(labels))
    ]


def _message(response: httpx.Response) -> str:
    """An error answer's message: ``{"error": "message"}`` under /v2 (Open Inference Protocol),
    ``{"error": {"code": ..., "message": ...}}`` elsewhere; else the start of the body."""
    try:
        error = response.json()["error"]
        v2 = response.request.url.path.startswith("/v2/")
        return str(error if v2 and isinstance(error, str) else error["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def _refusal(response: httpx.Response) -> str:
    return " ".join(f"HTTP {response.status_code}: {_message(response)}".split())


def _retry_after(response: httpx.Response, cap: float) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    try:
        return min(cap, max(0.0, float(value)))
    except ValueError:  # absent, or an HTTP date: use the backoff
        return None


# ---- running an async generator from synchronous code -------------------------------------------
def drive_results(results: AsyncGenerator[list[Row], None]) -> Iterator[list[Row]]:
    """Iterate ``results`` on a private event loop; closing the iterator (or an interruption)
    cancels whatever is still in flight."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(results.__anext__())
            except StopAsyncIteration:
                return
    finally:
        try:
            loop.run_until_complete(_cancel_all())
            loop.run_until_complete(results.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


async def _cancel_all() -> None:
    """Cancel and await every other task of the running loop."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
