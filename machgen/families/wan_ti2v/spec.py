"""Wan 2.2 TI2V-5B (Wan2.2-TI2V-5B-Diffusers): WanPipeline with
``expand_timesteps`` for text-to-video, and WanImageToVideoPipeline with
``expand_timesteps`` on the same folder for image-to-video, served as one
model (a request with an ``image`` makes it the first frame).

What sets it apart from the other Wan models (machgen/families/wan/), whose
parts it builds on:

- a timestep per video token: the transformer's time embedding and its
  modulations are per token ([batch, tokens, 6, inner]); the image's tokens
  (the first latent frame) take timestep 0;
- image-to-video conditions by replacing the first latent frame with the
  picture's latents in every step's input (and in the result), not by
  extra input channels;
- the Wan 2.2 VAE: 48 latent channels, residual blocks, and a 2x2
  patchified layout (16x spatial compression), chunked along time as Wan's.

Components, as Triton serves them: ``text_encoder``, ``denoiser_head``,
``denoiser_tail``, ``denoiser_reuse`` (their timestep per token),
``vae_decoder_first``, ``vae_decoder_next``, ``vae_encoder_first`` (the
picture: one frame), ``postprocess``.
"""

from __future__ import annotations

from dataclasses import replace

from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec, is_denoiser
from machgen.families.registry import Family, register_family
from machgen.families.wan.spec import GUIDANCE_SCALE_2

WAN_TI2V = register_family(Family(
    name="wan-ti2v",
    diffusers_pipeline="WanPipeline",
    capabilities=Capabilities(tasks=("text-to-video", "image-to-video"), guidance_is_cfg=True),
    runtime="machgen.families.wan_ti2v.runtime:WanTi2vRuntime",
    export="machgen.families.wan_ti2v.export:WanTi2vExport",
    tiny="machgen.families.wan_ti2v.tiny:tiny_wan_ti2v",
    inputs=(GUIDANCE_SCALE_2,),
    serves=lambda model_index: bool(model_index.get("expand_timesteps")),
))


def per_token_timestep_specs(specs: dict[str, ComponentSpec]) -> dict[str, ComponentSpec]:
    """Wan's denoiser specs with a timestep, and so a time embedding and
    modulation, per video token."""
    def per_token(tensor: TensorSpec) -> TensorSpec:
        if tensor.name == "timestep":
            return replace(tensor, shape=("batch", "video_tokens"))
        if tensor.name in ("temb", "timestep_proj"):
            return replace(tensor, shape=("batch", "video_tokens", *tensor.shape[1:]))
        return tensor

    return {name: replace(spec, inputs=tuple(map(per_token, spec.inputs)), outputs=tuple(map(per_token, spec.outputs)))
            if is_denoiser(name) else spec for name, spec in specs.items()}
