"""Peak memory of decoding a Wan video against its frame count: diffusers'
AutoencoderKLWan.decode (the whole float video, then postprocess) against
the served decode (vae_decoder_first / vae_decoder_next under ONNX Runtime,
one latent frame at a time, each chunk made uint8 at once).

The VAE has Wan 2.1's real architecture (base_dim 96, z_dim 16) with random
weights: memory and time depend on the shapes, not the values. Each
measurement runs in a fresh process; the figure is the growth of its peak
resident memory during the decode (ru_maxrss after minus before).

    python perf/bench_video_decode.py                    # 256x256, 9 to 65 frames
    python perf/bench_video_decode.py --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import record  # noqa: E402


class ResidentPeak:
    """The largest growth of this process's resident memory while inside the
    block, sampled every 5 ms (ru_maxrss would include loading's peak)."""

    def __enter__(self) -> "ResidentPeak":
        self.base = self.peak = self._resident_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._resident_mib())

    @property
    def growth_mib(self) -> float:
        return self.peak - self.base

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._resident_mib())

    @staticmethod
    def _resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _latents(frames: int, height: int, width: int):
    import torch

    return torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, generator=torch.Generator().manual_seed(0))


def measure(mode: str, folder: Path, frames: int, height: int, width: int) -> dict:
    """One decode in this process: peak growth (MiB) and seconds; the uint8 frames are saved next to the models."""
    import numpy as np
    import torch

    torch.set_grad_enabled(False)
    latents = _latents(frames, height, width)
    if mode == "diffusers":
        import diffusers

        vae = diffusers.AutoencoderKLWan.from_pretrained(folder / "vae").eval()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        start = time.perf_counter()
        with ResidentPeak() as peak:
            video = vae.decode(latents * std + mean).sample  # WanPipeline's un-normalisation
            images = ((video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8)[0].numpy()
            del video
    else:
        from machgen.families.wan.runtime import decode_video
        from machgen.runtime.onnx_runner import OnnxSession

        sessions = {name: OnnxSession(folder / f"{name}.onnx") for name in ("vae_decoder_first", "vae_decoder_next")}

        def run_component(name, inputs):
            if name == "postprocess":  # the served postprocess, as numpy
                frames = inputs["frames"]
                return {"images": (np.clip(frames / 2 + 0.5, 0, 1).transpose(0, 2, 3, 4, 1) * 255).round()
                        .astype(np.uint8)}
            return sessions[name].run(inputs)

        start = time.perf_counter()
        with ResidentPeak() as peak:
            images = decode_video(latents, run_component)
    seconds = time.perf_counter() - start
    np.save(folder / f"{mode}-{frames}.npy", images)
    return {"peak_mib": peak.growth_mib, "seconds": seconds}


def prepare(folder: Path) -> None:
    """The VAE (saved) and its two exported decoder components."""
    import diffusers
    import torch

    from machgen.builder.export import check_parity, export_onnx
    from machgen.families.wan.vae_chunks import vae_chunk_components

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=96, z_dim=16).eval()  # Wan 2.1's VAE configuration
    vae.save_pretrained(folder / "vae")
    for component in vae_chunk_components(vae, "decoder", temporal_factor=4):
        path = folder / f"{component.spec.name}.onnx"
        start = time.perf_counter()
        export_onnx(component, path)
        report = check_parity(component, path)
        print(f"{component.spec.name}: exported and checked (max diff {report.max_abs_diff:.2g}) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[9, 17, 33, 65])
    parser.add_argument("--size", default="256x256", help="HEIGHTxWIDTH in pixels")
    parser.add_argument("--record", type=Path, help="write the table into this RESULTS.md")
    parser.add_argument("--workdir", type=Path, help="keep the VAE and its exported components here (reused)")
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    height, width = (int(v) for v in args.size.split("x"))
    if args.measure:  # a child process: one measurement, printed as JSON
        mode, folder = args.measure
        print(json.dumps(measure(mode, Path(folder), args.frames[0], height, width)))
        return
    import numpy as np

    rows = []
    with tempfile.TemporaryDirectory(prefix="machgen-video-decode-") as temporary:
        scratch = str(args.workdir or temporary)
        if not (Path(scratch) / "vae_decoder_next.onnx").is_file():
            prepare(Path(scratch))
        for frames in args.frames:
            results = {}
            for mode in ("diffusers", "chunked"):
                out = subprocess.run([sys.executable, __file__, "--measure", mode, scratch, "--frames", str(frames),
                                      "--size", args.size], check=True, capture_output=True, text=True).stdout
                results[mode] = json.loads(out.strip().splitlines()[-1])
            videos = [np.load(Path(scratch) / f"{mode}-{frames}.npy").astype(np.int16) for mode in results]
            assert videos[0].shape == videos[1].shape == (frames, height, width, 3), [v.shape for v in videos]
            same = int(np.abs(videos[0] - videos[1]).max())
            rows.append((frames, results, same))
            print(f"{frames} frames: diffusers {results['diffusers']['peak_mib']:.0f} MiB "
                  f"{results['diffusers']['seconds']:.1f} s, chunked {results['chunked']['peak_mib']:.0f} MiB "
                  f"{results['chunked']['seconds']:.1f} s, max pixel difference {same}", flush=True)
    lines = [f"Wan 2.1 VAE architecture (random weights), {width}x{height}, {os.cpu_count()} cores, "
             f"{platform.processor() or platform.machine()}; peak resident memory growth during the decode, "
             "fresh process each.", "",
             "| frames | diffusers decode | served decode (chunked) | ratio | diffusers s | served s | max diff /255 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for frames, results, same in rows:
        d, c = results["diffusers"], results["chunked"]
        lines.append(f"| {frames} | {d['peak_mib']:.0f} MiB | {c['peak_mib']:.0f} MiB | "
                     f"{d['peak_mib'] / max(c['peak_mib'], 1):.1f}x | {d['seconds']:.1f} | {c['seconds']:.1f} | {same} |")
    table = "\n".join(lines)
    print(table)
    if args.record:
        record(args.record, "video-decode:Wan VAE", table, "Video decode memory")


if __name__ == "__main__":
    main()
