"""What Triton runs, and LocalPipeline in-process: the Python-backend models, the sampler and the
family runtime base, cache policies, the components' runners. It imports no build code."""
