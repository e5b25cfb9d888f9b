"""HiDream-I1: text-to-image. See spec.py."""
