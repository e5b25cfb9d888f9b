"""Median time of a call for the GPU scripts (gpu_attention.py, gpu_step.py):
CUDA events on a GPU, the clock on the CPU. Imports only torch, so that it
runs on a GPU host that has none of machgen's other dependencies."""

from __future__ import annotations

import time

import torch


def median_ms(function, device: torch.device | str = "cuda", repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``repeats`` calls of ``function`` after ``warmup`` calls."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            function()
            times.append((time.perf_counter() - begin) * 1e3)
    return sorted(times)[len(times) // 2]


def clock_ms(function, repeats: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``function`` (the host's clock), sorted, after ``warmup`` calls."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        function()
        times.append((time.perf_counter() - begin) * 1e3)
    return sorted(times)
