"""LTX-2: text-to-video and image-to-video with their sound. See spec.py."""
