"""What the build and the run time share, and nothing else: the repository
layout and its versioned manifest (``manifest.py``), the tensor and
component specs families declare (``specs.py``), the public API of a served
model (``api.py``), a request's parsing (``request.py``) and each input's
checks (``validation.py``), the tasks by both their names (``tasks.py``),
per-request adapters (``adapters.py``) and the TensorRT engine metadata
check (``engines.py``).

Importing it needs only numpy: the Triton models, the in-process pipeline,
the client and ``machgen-build`` all read it, and it imports none of them.
"""
