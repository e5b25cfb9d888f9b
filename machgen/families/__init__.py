"""Model families: one package each (``flux/``, ``wan/``, ...), with

- ``spec.py``    what the family serves, registered with ``register_family``:
                 pipelines, capabilities, its own API inputs, its components'
                 tensor specs and axis ranges (light: no torch, no diffusers)
- ``export.py``  the torch wrappers and the ``FamilyExport`` the builder
                 exports with (build time only)
- ``runtime.py`` the ``FamilyRuntime`` the sampler runs (run time only)
- ``tiny.py``    tiny random-weight pipelines for tests (build time only)

``registry.py`` finds them; docs/adding-a-family.md walks through adding one.
"""
