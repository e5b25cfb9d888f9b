"""machgen: fast serving of image and video diffusion models on Triton Inference Server (README.md)."""
