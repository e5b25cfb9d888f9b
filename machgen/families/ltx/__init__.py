"""LTX-Video: text-to-video and image-to-video. See spec.py."""
