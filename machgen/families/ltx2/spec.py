"""LTX-2: diffusers' LTX2Pipeline (text-to-video with its sound track) and
LTX2ImageToVideoPipeline (``ltx2-i2v``: image-to-video, which adds
``vae_encoder`` and takes a timestep per video token).

One transformer denoises two streams together, the video's latent tokens
and the sound's (a latent mel spectrogram), which attend to each other in
every block. Components, as Triton serves them:

- ``text_encoder``    Gemma 3 (every layer's hidden states) and the text
  connectors in one graph: input ids and mask -> the video's and the
  sound's text embeddings and the connectors' mask
- ``denoiser_head``   both streams' input projections, the timestep,
  prompt and cross-modal modulations, the rotary embeddings and the first
  block; also outputs that block's residual
- ``denoiser_tail``   the remaining blocks and both output layers
- ``denoiser_reuse``  input projections plus a kept blocks residual, output
  layers: the prediction of a step that skips the blocks
- ``vae_decoder``     video latents -> every frame in [-1, 1], in one call
  (the decoder is not causal, as LTX-Video's)
- ``audio_decoder``   the sound's latents -> mel spectrogram (audio VAE) ->
  waveform (vocoder), [channels, samples]
- ``postprocess``     frames in [-1, 1] -> uint8 [frames, H, W, 3]

The sampler's latents are both streams' packed latents side by side in one
flat row per request, [1, video tokens x channels + sound tokens x
channels]: the pipeline steps its two schedulers with the same sigmas, and
FlowMatchEuler's step is elementwise, so one scheduler over the row is the
same. Predictions and the kept residuals are packed the same way.

Guidance, as LTX2Pipeline: classifier-free (a negative-prompt row),
spatio-temporal (a row whose self-attention in ``stg_blocks`` is replaced
by its values), modality isolation (a row without the audio-video
cross-attention), combined in x0 space with the guidance rescale, each
with the sound's own scales. The pipeline makes one to three transformer
calls per step; here every row it needs is one batch of one call: each row
carries its perturbation mask per block and its cross-modal mask (both
exact: a perturbed self-attention's lerp to its values, a cross-attention
output times 0).
"""

from __future__ import annotations

from machgen.contract.api import ApiTensor, FamilyInput
from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec
from machgen.contract.validation import fraction_input, guidance_scale_input, indices_input
from machgen.families.ltx.spec import whole_video_decoder_specs
from machgen.families.registry import Family, register_family


def _scale(field, value, settings) -> float:
    return guidance_scale_input(field, value)


def _fraction(field, value, settings) -> float:
    return fraction_input(field, value)


def _blocks(field, value, settings) -> list[int]:
    return list(indices_input(field, value, settings["layers"]))


def _sound(name: str, parse, default: float) -> FamilyInput:
    """The sound's own value of the video's guidance input ``name``."""
    return FamilyInput(ApiTensor(f"audio_{name}", "FP32", (1,),
                                 f"LTX-2: the sound's `{name}`; absent or 0 takes the video's (LTX2Pipeline's `or`)"),
                       default=default, parse=parse)


# LTX2Pipeline's guidance (the LTX-2.3 recipe), as API inputs with its defaults.
STG_SCALE = FamilyInput(ApiTensor(
    "stg_scale", "FP32", (1,), "LTX-2: spatio-temporal guidance, away from a pass whose self-attention in "
                               "`stg_blocks` is replaced by its values (0: off)"), default=1.0, parse=_scale)
STG_BLOCKS = FamilyInput(ApiTensor(
    "stg_blocks", "INT32", (-1,), "LTX-2: the transformer blocks (0-based, distinct) that pass perturbs"),
    default=[28], parse=_blocks, cli_flag="--stg-block", default_doc="model's ([28], as LTX2Pipeline)")
MODALITY_SCALE = FamilyInput(ApiTensor(
    "modality_scale", "FP32", (1,), "LTX-2: modality isolation guidance, away from a pass without the "
                                    "audio-video cross-attention (1: off)"), default=3.0, parse=_scale)
GUIDANCE_RESCALE = FamilyInput(ApiTensor(
    "guidance_rescale", "FP32", (1,), "LTX-2: rescales the guided x0's spread toward the conditional one's, 0-1 "
                                      "(0: off)"), default=0.7, parse=_fraction)
LTX2_INPUTS = (STG_SCALE, STG_BLOCKS, MODALITY_SCALE, GUIDANCE_RESCALE, _sound("guidance_scale", _scale, 7.0),
               _sound("stg_scale", _scale, 1.0), _sound("modality_scale", _scale, 3.0),
               _sound("guidance_rescale", _fraction, 0.7))

LTX2 = register_family(Family(
    name="ltx2",
    diffusers_pipeline="LTX2Pipeline",
    capabilities=Capabilities(tasks=("text-to-video",), guidance_is_cfg=True, audio=True),
    runtime="machgen.families.ltx2.runtime:Ltx2Runtime",
    export="machgen.families.ltx2.export:Ltx2Export",
    tiny="machgen.families.ltx2.tiny:tiny_ltx2",
    inputs=LTX2_INPUTS,
))
LTX2_I2V = register_family(Family(
    name="ltx2-i2v",
    diffusers_pipeline="LTX2ImageToVideoPipeline",
    capabilities=Capabilities(tasks=("image-to-video",), guidance_is_cfg=True, audio=True),
    runtime="machgen.families.ltx2.runtime:Ltx2ImageToVideoRuntime",
    export="machgen.families.ltx2.export:Ltx2Export",
    tiny="machgen.families.ltx2.tiny:tiny_ltx2_i2v",
    inputs=LTX2_INPUTS,
))


def ltx2_specs(*, video_text_dim: int, audio_text_dim: int, inner_dim: int, audio_inner_dim: int,
               in_channels: int, audio_channels: int, layers: int, latent_channels: int,
               audio_latent_channels: int, sound_channels: int,
               image_to_video: bool) -> dict[str, ComponentSpec]:
    latents = TensorSpec("hidden_states", "float32", ("batch", "video_tokens", in_channels))
    audio_latents = TensorSpec("audio_hidden_states", "float32", ("batch", "audio_tokens", audio_channels))
    text = TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", video_text_dim))
    audio_text = TensorSpec("audio_encoder_hidden_states", "float32", ("batch", "text_tokens", audio_text_dim))
    mask = TensorSpec("encoder_attention_mask", "float32", ("batch", "text_tokens"))
    timestep = TensorSpec("timestep", "float32", ("batch", 1))
    video_coords = TensorSpec("video_coords", "float32", ("batch", 3, "video_tokens", 2))
    audio_coords = TensorSpec("audio_coords", "float32", ("batch", 1, "audio_tokens", 2))
    # 1: the block's self-attention as usual; 0: replaced by its values (spatio-temporal guidance).
    perturbation = TensorSpec("perturbation_mask", "float32", ("batch", layers))
    # 1: the audio-video cross-attention as usual; 0: left out (modality isolation guidance).
    cross_modal = TensorSpec("cross_modal_mask", "float32", ("batch", 1))
    video_hidden = TensorSpec("video_hidden", "float32", ("batch", "video_tokens", inner_dim))
    audio_hidden = TensorSpec("audio_hidden", "float32", ("batch", "audio_tokens", audio_inner_dim))
    residual = ("batch", "packed_hidden")
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", "packed_latents"))
    step_inputs = (text, audio_text, mask, timestep, video_coords, audio_coords, perturbation, cross_modal)
    timesteps = (timestep,)
    if image_to_video:
        # A timestep per video token (0 on the first frame's, which hold the picture); the sound's, the
        # prompt modulation's and the cross-modal ones stay the step's.
        video_timestep = TensorSpec("video_timestep", "float32", ("batch", "video_tokens"))
        step_inputs, timesteps = step_inputs + (video_timestep,), timesteps + (video_timestep,)
    specs = [
        ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "text_tokens")), TensorSpec(
                "attention_mask", "int64", ("batch", "text_tokens"))),
            outputs=(text, audio_text, mask),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "denoiser_head",
            inputs=(latents, audio_latents, *step_inputs),
            outputs=(video_hidden, audio_hidden, TensorSpec("first_block_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_tail",
            inputs=(video_hidden, audio_hidden, *step_inputs),
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_reuse",
            inputs=(latents, audio_latents, *timesteps, TensorSpec("blocks_residual", "float32", residual)),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
        ComponentSpec(
            "audio_decoder",
            inputs=(TensorSpec("audio_latents", "float32", ("batch", "audio_tokens", audio_latent_channels)),),
            outputs=(TensorSpec("waveform", "float32", ("batch", sound_channels, "samples")),),
            tolerance=1e-4,
        ),
        *whole_video_decoder_specs(latent_channels),
    ]
    if image_to_video:
        latent = ("batch", latent_channels, 1, "latent_height", "latent_width")
        specs.append(ComponentSpec(
            "vae_encoder",
            inputs=(TensorSpec("frames", "float32", ("batch", 3, 1, "height", "width")),),
            outputs=(TensorSpec("latents", "float32", latent),),
            tolerance=1e-3,
        ))
    return {s.name: s for s in specs}
