"""A generated model repository run in-process: the same sampler, the same
exported files and the same API validation as Triton serves, without a server.

For calibration, benchmarks and tests that compare served output with what
the same code gives locally.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from machgen.contract.adapters import served_adapters
from machgen.contract.api import API_INPUTS, Generated, input_array
from machgen.contract.manifest import COMPONENT_FILES, PipelineManifest, pipeline_dir
from machgen.contract.request import check_option_names
from machgen.runtime.components import InSamplerComponents, open_component
from machgen.runtime.sampler import GenerationStats, load_sampler


class LocalPipeline:
    """``LocalPipeline(repository, name).generate(prompt, seed=..., ...)``."""

    def __init__(self, repository: Path, name: str, intra_op_threads: int = 0, layout: Any = None):
        """``layout``: run a parallel build's components under another layout it allows (a
        parallel.layout.ParallelLayout; one rank: as plain programs; ``use_layout`` changes it). ``close``
        stops their ranks."""
        self.repository = Path(repository)
        self.name = name
        self._layout = layout
        sampler_dir = pipeline_dir(self.repository, name)
        self.manifest = PipelineManifest.read(sampler_dir)
        self._intra_op_threads = intra_op_threads
        self._sessions: dict[str, Any] = {}
        self._parked: dict[int, dict[str, Any]] = {}  # world size: components put aside by use_layout
        self._opening = threading.Lock()
        self._adapters, self._max_loaded = served_adapters(self.manifest.adapters, sampler_dir)
        self.in_sampler = InSamplerComponents(self.manifest.components, sampler_dir, self._adapters,
                                              self._max_loaded)
        self.sampler = load_sampler(self.manifest, str(sampler_dir), self.run_component)
        self.inputs = {tensor.name: tensor for tensor in API_INPUTS}
        self.inputs.update({declared.name: declared.tensor for declared in self.sampler.runtime.family.inputs})

    def run_component(self, component: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if component in self.in_sampler:
            return self.in_sampler.run(component, inputs)
        return self._session(component).run(inputs)

    def runner(self, component: str) -> Any:
        """The runner of a component served by its own Triton model, opened on first use (a parallel
        component's: its ParallelProgram, with its counts of calls)."""
        return self._session(component)

    def opened_runners(self) -> dict[str, Any]:
        """The runners opened so far under the current layout, by component (runner's, none opened here)."""
        with self._opening:
            return dict(self._sessions)

    def _session(self, component: str) -> Any:
        # Opened on first use, one at a time: the text encoders are called at once (FamilyRuntime.run_components),
        # and torch.export.load keeps global state while it reads a program.
        with self._opening:
            if component not in self._sessions:
                path = self.repository / self.manifest.components[component].model / "1" / \
                    COMPONENT_FILES[self.manifest.target]
                self._sessions[component] = open_component(path, intra_op_threads=self._intra_op_threads,
                                                           adapters=self._adapters, max_loaded=self._max_loaded,
                                                           layout=self._layout)
            return self._sessions[component]

    def use_layout(self, layout: Any) -> None:
        """Run the parallel build's components under ``layout`` from now on (a
        ParallelLayout the build allows). Those whose layout decides how they
        run are put aside with their ranks, by world size, and taken up again
        by the next layout of that size, which remakes only the ranks' process
        groups; the components that run in this process under every layout
        stay loaded. So runs comparing layouts load each program once per
        world size. ``close`` stops every rank."""
        from machgen.parallel.program import move_to_layout

        with self._opening:
            leaving = {name: self._sessions.pop(name) for name in list(self._sessions) if self._on_ranks(name)}
            self._close_all(self._parked.pop(self._world_size(self._layout), {}))
            if leaving:
                self._parked[self._world_size(self._layout)] = leaving
            resumed = self._parked.pop(self._world_size(layout), {})
            if resumed and layout.world_size > 1 and not move_to_layout(list(resumed.values()), layout):
                self._close_all(resumed)
                resumed = {}
            self._sessions.update(resumed)
            self._layout = layout

    def _world_size(self, layout: Any) -> int:
        if layout is not None:
            return layout.world_size
        from machgen.parallel.layout import ParallelLayout

        return ParallelLayout.from_json(self.manifest.parallel).world_size if self.manifest.parallel else 1

    @staticmethod
    def _close_all(sessions: dict[str, Any]) -> None:
        for session in sessions.values():
            getattr(session, "close", lambda: None)()

    def _on_ranks(self, component: str) -> bool:
        """Whether the layout decides how ``component`` runs (a torch program built for a parallel layout)."""
        if self.manifest.target != "torch":
            return False
        from machgen.runtime.torch_runner import TorchComponentInfo

        return TorchComponentInfo.read(self.repository / self.manifest.components[component].model / "1"
                                       ).parallel is not None

    def close(self) -> None:
        """Stop what the components run besides this process (a parallel component's ranks)."""
        with self._opening:
            self._close_all(self._sessions)
            self._sessions.clear()
            for parked in self._parked.values():
                self._close_all(parked)
            self._parked.clear()

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release_memory(self) -> None:
        """Every opened session's grown memory given back (onnx_runner.release_memory), while runs may go on."""
        from machgen.runtime.onnx_runner import release_memory

        self.in_sampler.release_memory()
        release_memory(*self.opened_runners().values())

    def streaming(self, **options: Any):
        """A runtime.streaming.StreamingEngine of this model's realtime sessions (options: the engine's; its
        ``release_if_idle`` releases this pipeline's memory once every session has closed)."""
        from machgen.runtime.streaming.engine import streaming_engine

        options.setdefault("fps", self.manifest.defaults.fps or 16)
        options.setdefault("release_memory", self.release_memory)
        return streaming_engine(self.sampler.runtime, self.run_component, **options)

    def generate(self, prompt: str, **options: Any) -> tuple[np.ndarray, GenerationStats]:
        """Images [1, H, W, 3] (every frame of a video) and stats; options are the API's optional inputs."""
        images, _, stats = self.generate_with_audio(prompt, **options)
        return images, stats

    def generate_with_audio(self, prompt: str, **options: Any) -> tuple[np.ndarray, np.ndarray | None,
                                                                         GenerationStats]:
        """``generate`` plus the sound track [channels, samples] (None for a silent model)."""
        generated = self.generate_all(prompt, **options)
        return generated.images, generated.audio, generated.stats

    def generate_all(self, prompt: str, **options: Any) -> Generated:
        """Everything a served request gives back (stats as GenerationStats), the trajectory included."""
        from machgen.families.registry import family_inputs

        check_option_names(options, self.inputs, family_inputs())
        arrays = {name: input_array(self.inputs[name], value)
                  for name, value in {"prompt": prompt, **options}.items() if value is not None}
        request = self.sampler.parse_request(arrays.get, self.manifest.defaults)
        result = self.sampler.generate(request)
        return Generated(self.sampler.decode(result.latents), self.sampler.decode_audio(result.latents), result.stats,
                         result.trajectory)
