"""Wan 2.1 and 2.2: text-to-video (two experts), image-to-video, VACE reference-to-video. See spec.py."""
