"""The Python-backend models a served repository runs.

The generated ``model.py`` shims in a model repository import one of these
classes as ``TritonPythonModel``:

- ``relays.PublicModel``: the public model NAME, one instance per request in
  flight. It holds no model code (numpy only): it relays each request to
  the sampler and answers with its result, passing on a client's
  cancellation (which it looks for every ``CANCEL_POLL_S``: it asks for no
  progress).
- ``relays.StreamModel``: NAME_stream, the public model's decoupled twin:
  the same relay, on one instance's threads, passing on the sampler's
  progress responses (and previews) before the result.
- ``sampler.SamplerModel``: NAME_sampler, one decoupled instance running
  every in-flight request's denoising loop on its own thread (BLS calls to
  the components release the GIL, so the loops overlap), so the libraries
  the loop needs (torch, diffusers, tokenizers) are loaded once, not once
  per request in flight. It answers a request with its result, after a
  progress response per step where the relay asks (NAME_stream does).
- ``components.OnnxComponentModel``, ``components.TorchComponentModel``: one
  pipeline component. (tensorrt-target components are served by Triton's
  TensorRT backend.)

Why two models and not one: a decoupled model cannot answer plain infer
(HTTP, gRPC unary, perf_analyzer), and a plain Python model handles one
request per instance process at a time. Errors travel from the sampler to
the public model as an ``error`` output (BLS in Triton 2.51 drops the
error responses of a decoupled model).

``backend`` is the only module that imports triton_python_backend_utils;
where a sampler call goes (runtime/routes.py) and everything else the
models decide runs under plain unit tests.
"""

import faulthandler

from machgen.runtime.processes import STACKS_SIGNAL

# Asked by a start that hangs (machgen/server.py): where this stub's threads wait, in the server log.
faulthandler.register(STACKS_SIGNAL, all_threads=True)
