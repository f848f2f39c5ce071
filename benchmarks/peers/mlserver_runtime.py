"""The MLServer peer of :mod:`benchmarks.service_peers`: a custom runtime serving the bundle's Guard
over MLServer's Open Inference Protocol, with its adaptive batching on (set in model-settings.json
by the benchmark). Runs in the peers' virtual environment."""

from __future__ import annotations

import asyncio

import torch
from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

from benchmarks.peers.v2_images import decode_b64_images, predict_images, torch_threads, v2_outputs
from detector.guard import Guard


class GuardRuntime(MLModel):
    """``parameters.uri`` is the bundle directory."""

    async def load(self) -> bool:
        torch.set_num_threads(torch_threads())
        self.guard = Guard.from_bundle(str(self.settings.parameters.uri), device="cpu")
        self.guard.warmup()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        images = decode_b64_images(list(payload.inputs[0].data))
        result = await asyncio.to_thread(predict_images, self.guard, images)
        return InferenceResponse(
            model_name=self.name,
            outputs=[ResponseOutput(**output) for output in v2_outputs(result)],
        )
