"""What differs between diffusion model families, behind one small interface.

A family (SD 1.x/2.x, SDXL, SD3/SD3.5, FLUX) says how prompts become conditioning, how the denoiser
is called, what the training target is, how latents map to pixels and which modules LoRA adapts.
Trainers, evaluation, best-of-N, the latent precompute and the memory planner ask the family and never the
pipeline class; what the planner and the latent store need before any weight loads (native resolution, latent
shape, text tokens, the conditioning's shapes) are methods of the family that read the config files alone.
Adding a family is one new file in this package and one line in ``align/families/__init__.py``
(docs/development.md#adding-a-model-family).

Conventions every family keeps:

- **Conditioning** is a dict of batch-first tensors (``prompt_embeds`` always; ``pooled_embeds``,
  ``time_ids``, ... where the family has them), so batches of it are concatenated, indexed and
  repeated with the helpers below without knowing the family.
- **Latents** are ``[B, C, H, W]`` and already scaled (and shifted) for the denoiser; a family that
  packs latents into tokens (FLUX) does so inside ``predict``.
- **Timesteps** are the values the family's scheduler lists in ``scheduler.timesteps``: integer
  DDPM steps for UNet families, ``σ · 1000`` for flow-matching families.
"""

from __future__ import annotations

from pathlib import Path

import torch

Conditioning = dict[str, torch.Tensor]
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name every pipeline's load_lora_weights looks for


class ModelLoadError(ValueError):
    pass


def dtype_argument(dtype: torch.dtype) -> dict:
    """``from_pretrained``'s dtype keyword: ``dtype=`` where diffusers has it (``torch_dtype=`` is deprecated
    there and warns), ``torch_dtype=`` on the older releases that know only that name."""
    from diffusers.utils import deprecation_utils

    return {"dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype": dtype}


def lora_metadata(denoiser) -> dict:
    """The adapter's LoRA config (rank, alpha, targets) saved beside its weights, so that ``load_lora_weights`` scales
    it as trained when alpha differs from the rank (diffusers' training scripts save the same metadata)."""
    return denoiser.peft_config["default"].to_dict()


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def pretrained_pipeline(pipeline_class, model: str, dtype: torch.dtype, family_name: str, quantization=None,
                        **components):
    """``pipeline_class.from_pretrained`` whose failures (a missing folder, an unknown hub id, a truncated
    or corrupt weights file) are one ModelLoadError line. ``quantization``: diffusers' ``PipelineQuantizationConfig``
    of the components loaded quantized (align/train/quantization.py), or None."""
    from safetensors import SafetensorError  # a truncated weights file raises this, not an OSError

    if quantization is not None:
        components["quantization_config"] = quantization
    try:
        return pipeline_class.from_pretrained(model, **dtype_argument(dtype), **components)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as err:
        raise ModelLoadError(f"cannot load a {family_name} pipeline from {model!r}: {one_line(err)}") from err


def cat_conditioning(parts: list[Conditioning]) -> Conditioning:
    """The batches of ``parts`` one after the other. Token sequences of different lengths (Qwen-Image and Z-Image
    encode each prompt to its own length) are right-padded with zeros to the longest, as the pipelines pad a batch:
    the family's ``*_mask`` tensor, padded with zeros too, marks the padding."""
    return {key: torch.cat(pad_to_longest([part[key] for part in parts])) for key in parts[0]}


def pad_to_longest(tensors: list[torch.Tensor], dim: int = 1) -> list[torch.Tensor]:
    """Tensors whose dimension ``dim`` (the tokens: 1 in a batch, 0 in one item) differs, zero-padded at its end to the
    longest."""
    if all(t.ndim <= dim for t in tensors) or len({t.shape[dim] for t in tensors}) == 1:
        return tensors
    longest = max(t.shape[dim] for t in tensors)
    return [torch.nn.functional.pad(t, (0, 0) * (t.ndim - dim - 1) + (0, longest - t.shape[dim])) for t in tensors]


def select_conditioning(cond: Conditioning, index) -> Conditioning:
    """Rows ``index`` (an int tensor, a slice or a list) of every tensor."""
    return {key: value[index] for key, value in cond.items()}


def repeat_conditioning(cond: Conditioning, times: int) -> Conditioning:
    """Each row repeated ``times`` times in place (row-major, as ``repeat_interleave``)."""
    return {key: value.repeat_interleave(times, dim=0) for key, value in cond.items()}


def expand_conditioning(cond: Conditioning, batch: int) -> Conditioning:
    """A one-row conditioning (the empty prompt's) broadcast to ``batch`` rows."""
    return {key: value.expand(batch, *value.shape[1:]) for key, value in cond.items()}


def conditioning_to(cond: Conditioning, device=None, dtype=None) -> Conditioning:
    """Every tensor moved; ``dtype`` applies to floating tensors only."""
    return {key: value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
            for key, value in cond.items()}


def vae_scale_factor(vae_config) -> int:
    """The VAE's downsampling, as the pipelines compute it: 2 ** (number of blocks - 1)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def config_of(module) -> dict:
    """A model's config (through an accelerate/DDP wrapper) as a plain mapping."""
    return dict(getattr(module, "module", module).config)


class ModelFamily:
    """One model family. Subclasses set the attributes and implement the methods."""

    name: str = ""
    title: str = ""  # as messages name the family: "Stable Diffusion XL"
    pipeline_class_names: tuple[str, ...] = ()  # model_index.json ``_class_name`` values handled
    denoiser_name: str = "unet"  # the pipeline attribute that is trained
    is_flow: bool = False  # flow matching (velocity, σ schedule) rather than DDPM/DDIM
    # Instruction editing: a prompt is an instruction and a source image (rewards.edit_prompts) whose latents are
    # conditioning (``source_latents``, of ``source_latent_shape_of``); the trainers, the planner and the judges read it.
    edits: bool = False
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    # FSDP2's units (align/train/sharding.py): the UNet's transformer blocks and resnet blocks (whole down/up blocks
    # are too coarse: SDXL's first up block alone is ~1 B parameters, gathered whole for its forward)
    shard_blocks: tuple[str, ...] = ("BasicTransformerBlock", "ResnetBlock2D")
    # The pipeline's default sample size where its denoiser's config names none (FluxPipeline: 128).
    default_sample_size: int | None = None
    text_tokens_clip: int = 77  # CLIP's padded prompt length

    # --- loading and saving -------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        """The family's diffusers pipeline from a local folder or hub id, progress bars off, on ``device``
        (UNet families with a DDIM scheduler, as the trainers sample with DDIM). ``dtype`` may be a dict by component
        name (diffusers' ``{"transformer": torch.bfloat16, "default": torch.float32}``); ``quantization`` goes to
        ``pretrained_pipeline`` (a quantized frozen base: align/train/quantization.py)."""
        raise NotImplementedError

    def denoiser(self, pipe) -> torch.nn.Module:
        return getattr(pipe, self.denoiser_name)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        """Everything but the denoiser that holds weights (text encoders, VAE)."""
        raise NotImplementedError

    def save_lora(self, denoiser, folder: str | Path) -> Path:
        """Write the denoiser's LoRA as ``folder/pytorch_lora_weights.safetensors`` in the format this
        family's pipeline ``load_lora_weights`` reads; returns the file."""
        raise NotImplementedError

    def load_lora(self, pipe, folder: str | Path) -> None:
        """Load a LoRA written by ``save_lora`` into the pipeline's denoiser."""
        raise NotImplementedError

    # --- conditioning and latents -------------------------------------------------------------
    def encode_prompts(self, pipe, prompts: list[str], resolution: int) -> Conditioning:
        """Conditioning of each prompt (no classifier-free guidance pairing: call it with ``[""]`` for
        the unconditional side). ``resolution`` feeds size conditioning where the family has it."""
        raise NotImplementedError

    def unconditional(self, pipe, batch: int, resolution: int | None = None) -> Conditioning:
        """The unconditional side of classifier-free guidance, ``batch`` rows (broadcast views): what the
        family's pipeline uses when no negative prompt is given. Default: the encoded empty prompt; SDXL
        overrides it (zeros under ``force_zeros_for_empty_prompt``)."""
        return expand_conditioning(self.encode_prompts(pipe, [""], resolution), batch)

    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """Denoiser-space latents (posterior mean, scaled/shifted) of pixels in [-1, 1]."""
        raise NotImplementedError

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] from denoiser-space latents."""
        raise NotImplementedError

    def latent_shape(self, pipe, resolution: int) -> tuple[int, int, int]:
        """(C, H, W) of the latents of a square image of side ``resolution``."""
        return self.latent_shape_of(config_of(self.denoiser(pipe)), pipe.vae.config, resolution)

    def native_resolution(self, pipe) -> int:
        """The image side in pixels the pipeline generates when not told."""
        return self.native_resolution_of(config_of(self.denoiser(pipe)), pipe.vae.config)

    # --- shapes from the config files alone (the memory planner, the latent store) -----------------
    def native_resolution_of(self, denoiser_config, vae_config) -> int:
        """The image side the pipeline generates when not told, as its ``__call__`` computes it: the denoiser's
        sample size (or the pipeline's ``default_sample_size``) times the VAE's downsampling."""
        sample_size = denoiser_config.get("sample_size") or self.default_sample_size
        return int(sample_size) * vae_scale_factor(vae_config)

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        """(C, H, W) of the denoiser's latents for a square image of side ``resolution``."""
        side = int(resolution) // vae_scale_factor(vae_config)
        return (denoiser_config["in_channels"], side, side)

    def source_latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        """Editing families: (C, H, W) of the source image's latents in a run at ``resolution``; by default the generated
        image's (the source resized to the run's side)."""
        return self.latent_shape_of(denoiser_config, vae_config, resolution)

    def text_tokens(self, model: str | None = None) -> int:
        """The prompt's token count in the conditioning (the memory planner's attention sizes) of the pipeline in folder
        ``model`` (None: the family's defaults)."""
        return self.text_tokens_clip

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        """The shape of each conditioning tensor of ``batch`` prompts, as ``encode_prompts`` returns them."""
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["cross_attention_dim"])}

    def set_training_attention(self, denoiser) -> None:
        """Put the attention processors the trainers run (and the memory planner counts) in place."""

    # --- the denoiser and its training target -------------------------------------------------
    def uses_guidance_embedding(self, denoiser) -> bool:
        """True where the denoiser takes the guidance scale as an input (FLUX.1-dev) instead of
        classifier-free guidance's two calls."""
        return False

    def predict(self, denoiser, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The denoiser's output for ``latents`` [B, C, H, W] at ``timesteps`` [B], shaped like ``latents``."""
        raise NotImplementedError

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """Flow families: the σ schedule (N + 1 values from ~1 down to 0) the family's pipeline samples with
        at this resolution (shift, FLUX's resolution-dependent shift included)."""
        raise NotImplementedError(f"{self.name} is not a flow-matching family")

    def generation_kwargs(self, pipe) -> dict:
        """Extra keyword arguments for ``pipe(...)`` so that it generates as this toolkit encodes prompts
        (e.g. a flow testbed's short ``max_sequence_length``)."""
        return {}

    def draw_training_timesteps(self, scheduler, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Training timesteps [batch] drawn as the family's own training scripts draw them."""
        raise NotImplementedError

    def noisy_and_target(self, scheduler, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor):
        """(noisy latents, regression target of ``predict``) at ``timesteps``."""
        raise NotImplementedError

    # --- guidance and the pipeline's own call ------------------------------------------------------
    def guided_prediction(self, denoiser, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning,
                          uncond: Conditioning, guidance_scale: float) -> torch.Tensor:
        """The prediction the family's pipeline steps with at ``guidance_scale``, in float32: classifier-free
        guidance in one denoiser call (unconditional half first), the guidance embedding where the denoiser takes one.
        A family whose pipeline guides otherwise (two calls, a rescaled norm, another scale convention) overrides it.

        Float32 whatever the denoiser's output dtype: accelerate's prepared model returns float32 under
        fp16/bf16 and a bare one does not, and sampled and re-scored log-probabilities must agree bit for bit.
        """
        if self.uses_guidance_embedding(denoiser):
            guidance = torch.full((latents.shape[0],), float(guidance_scale), device=latents.device)
            return self.predict(denoiser, latents, timesteps, {**cond, "guidance": guidance}).float()
        if guidance_scale == 1.0:
            return self.predict(denoiser, latents, timesteps, cond).float()
        out = self.predict(
            denoiser, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]), cat_conditioning([uncond, cond])
        )
        uncond_out, cond_out = out.float().chunk(2)
        return uncond_out + guidance_scale * (cond_out - uncond_out)

    def call_arguments(self, pipe, prompts: list[str], guidance_scale: float, resolution: int | None = None) -> dict:
        """The keyword arguments of ``pipe(...)`` that generate ``prompts`` as ``guided_prediction`` samples them at
        ``guidance_scale`` (with ``generation_kwargs``), images of side ``resolution`` (None: the pipeline's own). A
        family whose pipeline names its guidance otherwise, or whose prompt carries a source image, overrides it."""
        return {"prompt": list(prompts), "guidance_scale": guidance_scale, **self.generation_kwargs(pipe)}

    def pipeline_latents(self, pipe, noise: torch.Tensor) -> torch.Tensor:
        """``noise`` [B, C, h, w] (this family's latents) in the layout the pipeline's ``latents=`` argument takes."""
        return noise


def guided_prediction(family: ModelFamily, denoiser, latents: torch.Tensor, timesteps: torch.Tensor,
                      cond: Conditioning, uncond: Conditioning, guidance_scale: float) -> torch.Tensor:
    """The family's guided prediction (``ModelFamily.guided_prediction``), in float32."""
    return family.guided_prediction(denoiser, latents, timesteps, cond, uncond, guidance_scale)
