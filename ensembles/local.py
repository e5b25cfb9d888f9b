"""A generated model repository run in-process: the same sampler, the same
exported files and the same API validation as Triton serves, without a server.

For calibration, benchmarks and tests that compare served output with what
the same code gives locally.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from machgen.builder.repository import TargetServing, model_name, pipeline_dir
from machgen.ensembles.api import API_INPUTS, input_array
from machgen.ensembles.components import InSamplerComponents, open_component
from machgen.ensembles.sampler import GenerationStats, load_sampler

_API = {t.name: t for t in API_INPUTS}


class LocalPipeline:
    """``LocalPipeline(repository, name).generate(prompt, seed=..., ...)``."""

    def __init__(self, repository: Path, name: str, intra_op_threads: int = 0):
        self.repository = Path(repository)
        self.name = name
        public_dir = pipeline_dir(self.repository, name)
        self.pipeline = json.loads((public_dir / "pipeline.json").read_text())
        # Repositories written before targets existed were ONNX Runtime ones.
        self._serving = TargetServing(self.pipeline.get("target", "onnxruntime"))
        self._intra_op_threads = intra_op_threads
        self._sessions: dict[str, Any] = {}
        self.in_sampler = InSamplerComponents(self.pipeline["components"], public_dir)
        self.sampler = load_sampler(self.pipeline, str(public_dir), self.run_component)

    def run_component(self, component: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if component in self.in_sampler:
            return self.in_sampler.run(component, inputs)
        if component not in self._sessions:
            path = self.repository / model_name(self.name, component) / "1" / self._serving.file_name
            self._sessions[component] = open_component(path, intra_op_threads=self._intra_op_threads)
        return self._sessions[component].run(inputs)

    def generate(self, prompt: str, **options: Any) -> tuple[np.ndarray, GenerationStats]:
        """Images [1, H, W, 3] (every frame of a video) and stats; options are the API's optional inputs."""
        images, _, stats = self.generate_with_audio(prompt, **options)
        return images, stats

    def generate_with_audio(self, prompt: str, **options: Any) -> tuple[np.ndarray, np.ndarray | None,
                                                                         GenerationStats]:
        """``generate`` plus the sound track [channels, samples] (None for a silent model)."""
        unknown = set(options) - set(_API)
        if unknown:
            raise TypeError(f"unknown generation options: {sorted(unknown)}")
        arrays = {name: input_array(_API[name], value)
                  for name, value in {"prompt": prompt, **options}.items() if value is not None}
        request = self.sampler.parse_request(arrays.get, self.pipeline["defaults"])
        result = self.sampler.generate(request)
        return self.sampler.decode(result.latents), self.sampler.decode_audio(result.latents), result.stats
