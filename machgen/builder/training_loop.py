"""What every training stage here shares: a progress bar, checkpoints every few minutes that a resumed run
starts from, a time budget, a cosine learning rate, and modules trained with an EMA of their weights."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np


def progress_bar(total: int, initial: int, description: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=description, dynamic_ncols=True, mininterval=2.0)


class Checkpointer:
    """Saves a stage's state every few minutes and at its end; loads it to resume."""

    def __init__(self, path: Path, every_minutes: float):
        self.path = path
        self.every = every_minutes * 60
        self.last = time.monotonic()

    def load(self):
        import torch

        return torch.load(self.path, weights_only=False) if self.path.is_file() else None

    def maybe_save(self, state_fn: Callable[[], dict], force: bool = False) -> None:
        import torch

        if force or time.monotonic() - self.last >= self.every:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            torch.save(state_fn(), partial)
            partial.replace(self.path)  # a crash mid-save leaves the previous checkpoint intact
            self.last = time.monotonic()


def budget_left(start_seconds: float, elapsed_before: float, minutes: float | None) -> bool:
    return minutes is None or elapsed_before + time.monotonic() - start_seconds < minutes * 60


def set_cosine_lr(optimizer, peak: float, floor: float, step: int, steps: int, elapsed_s: float,
                  minutes: float | None) -> None:
    """A cosine from ``peak`` to ``floor`` over the stage's progress: the larger of its share of steps and,
    with a time budget, of the budget used."""
    progress = step / steps
    if minutes:
        progress = max(progress, elapsed_s / (minutes * 60))
    for group in optimizer.param_groups:
        group["lr"] = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def resume_vae_stage(checkpoint: "Checkpointer | None", vae, optimizer, rng: np.random.Generator, stage: str,
                      log: Callable[[str], None]) -> tuple[int, float]:
    """(step, elapsed seconds) of a VAE stage, restored from its checkpoint when there is one."""
    state = checkpoint.load() if checkpoint is not None else None
    if state is None:
        return 0, 0.0
    vae.load_state_dict(state["vae"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["rng"]
    log(f"{stage}: resumed at step {state['step']}")
    return state["step"], state["elapsed"]


class EmaTraining:
    """Modules trained together (AdamW, linear warm-up, gradient clipping at
    1) with an EMA of their weights, which is the result; one checkpointed,
    resumable stage. ``batch_loss(rng)`` gives each step's loss."""

    def __init__(self, name: str, modules: list, lr: float, warmup_steps: int, ema_decay: float,
                 checkpoint: Checkpointer, rng: np.random.Generator):
        import torch

        self.name, self.modules, self.lr, self.warmup_steps, self.ema_decay = name, modules, lr, warmup_steps, ema_decay
        self.ema = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
        self.params = [p for m in modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
        self.checkpoint, self.rng = checkpoint, rng
        self.step, self.elapsed, self.losses = 0, 0.0, []

    def resume(self, log: Callable[[str], None]) -> None:
        import torch

        state = self.checkpoint.load()
        if state is None:
            return
        for module, saved in zip(self.modules + self.ema, state["modules"] + state["ema"]):
            module.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed, self.rng.bit_generator.state = state["step"], state["elapsed"], state["rng"]
        torch.set_rng_state(state["torch_rng"])
        self.losses = list(state["losses"])
        log(f"{self.name}: resumed at step {self.step}")

    def finished(self, steps: int, minutes: float | None) -> bool:
        return self.step >= steps or not budget_left(time.monotonic(), self.elapsed, minutes)

    def run(self, steps: int, minutes: float | None, batch_loss: Callable[[np.random.Generator], object],
            check: Callable[[int], None] | None = None, check_minutes: float | None = None) -> dict:
        """Steps until ``steps`` or the time budget; the stage's metrics.
        ``check(step)`` (a measurement of the EMA modules) runs every
        ``check_minutes`` and once at the end; its time counts in the budget."""
        import torch

        start, elapsed_before = time.monotonic(), self.elapsed
        last_check = start
        ema_params = [p for m in self.ema for p in m.parameters()]

        def snapshot() -> dict:
            self.elapsed = elapsed_before + time.monotonic() - start
            return {"modules": [m.state_dict() for m in self.modules], "ema": [m.state_dict() for m in self.ema],
                    "optimizer": self.optimizer.state_dict(), "step": self.step, "elapsed": self.elapsed,
                    "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "losses": self.losses}

        for module in self.modules:
            module.train()
        with progress_bar(steps, self.step, self.name) as bar:
            while self.step < steps and budget_left(start, elapsed_before, minutes):
                loss = batch_loss(self.rng)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.lr * min(1.0, (self.step + 1) / self.warmup_steps)
                self.optimizer.step()
                self.step += 1
                decay = min(self.ema_decay, (1 + self.step) / (10 + self.step))
                with torch.no_grad():
                    torch._foreach_lerp_(ema_params, self.params, 1 - decay)
                self.losses.append(loss.item())
                bar.update(1)
                if self.step % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(self.losses[-100:]):.4f}")
                self.checkpoint.maybe_save(snapshot)
                if check is not None and check_minutes and time.monotonic() - last_check >= check_minutes * 60:
                    check(self.step)
                    last_check = time.monotonic()
        self.checkpoint.maybe_save(snapshot, force=True)
        if check is not None:
            check(self.step)
        return self.metrics()

    def metrics(self) -> dict:
        return {"transformer_steps": self.step, "transformer_minutes": round(self.elapsed / 60, 1),
                "final_loss": round(float(np.mean(self.losses[-200:])), 4) if self.losses else None}
