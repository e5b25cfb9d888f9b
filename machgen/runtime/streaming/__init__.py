"""Realtime sessions: a video generated chunk by chunk with a cache of keys and values per session, the chunks
of many sessions batched into one denoiser call (contract/streaming.py declares a model's streaming mode)."""
