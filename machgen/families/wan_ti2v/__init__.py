"""Wan 2.2 TI2V-5B: text-to-video and image-to-video from one model. See spec.py."""
