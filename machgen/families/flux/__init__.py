"""Flux (FLUX.1 and Flux-architecture models): text-to-image and image-to-image. See spec.py."""
