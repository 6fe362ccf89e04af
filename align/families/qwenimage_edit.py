"""Qwen-Image-Edit: instruction editing with Qwen-Image's transformer. A prompt is an instruction and a source image
(``rewards.edit_prompts``); the instruction AND the source go through the Qwen2.5-VL text encoder together (the
pipeline's edit template, its first 64 tokens dropped), the source's VAE latents are packed into 2x2 tokens appended
after the generated image's (``img_shapes`` lists both grids), and the prediction is read off the generated tokens.

Matches diffusers' QwenImageEditPipeline (the template and the processor's image tokens, the source's posterior mode
normalised with the VAE's latents_mean/std, the packed tokens and ``img_shapes``, ``timestep / 1000``, the σ schedule
of the generated image's token count, true CFG on two calls rescaled to the conditional norm with the negative prompt
encoded on the same source) and Qwen-Image's training script as the text-to-image family does (align/families/
qwenimage.py: uniform timesteps, velocity target ε - x0, on the generated tokens only). Deliberate differences:

- the source keeps the pipeline's size, not the run's: QwenImageEditPipeline resizes every source to about 1024 x 1024
  px (``calculate_dimensions(1024 * 1024, ratio)``) and, unlike FluxKontextPipeline, takes no argument to change that;
  so that the pipeline (AI feedback, evaluation, best-of-N) generates what the family samples and trains on, the family
  sizes sources with the same function: 1024 x 1024 px (rewards.edit_prompts loads every source square, where the
  pipeline would keep a file's aspect ratio), 4,096 source tokens at any resolution. ``call_arguments`` passes the
  sources already at that size; its callers pass the run's side as ``height`` and ``width``.
- the negative prompt is " " (Qwen-Image-Edit's model card) on each prompt's own source, as the pipeline encodes it:
  the conditioning of an edit carries it (``negative_prompt_embeds``); ``guided_prediction`` ignores the trainers'
  shared unconditional rows and guides each row against its own source's negative prompt.
- a dropped instruction (caption dropout, ``[source: ...] `` with no instruction) is that negative prompt, the branch
  true CFG uses at inference (the pipeline would encode the empty string); the empty prompt "" (what the trainers and
  the latent store encode for the unconditional side) encodes to the ``unconditional`` row flag alone, which
  ``predict`` resolves against the row's own source, so a latent store's dropped captions keep their source in the
  text encoder too. Any other plain prompt is refused.
- the planner counts prompts of ``PLANNED_PROMPT_TOKENS`` tokens (align/families/qwenimage.py) plus the source's image
  tokens (the processor's resize of the 1024 px source, its patches merged 2x2).
- without torchvision (transformers builds Qwen2VLProcessor's video processor only with it) the processor loads
  without its video processor, as rewards.vlm loads the VLM judges'; editing never calls it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from align.families import flow_common
from align.families.base import Conditioning, ModelLoadError, pad_to_longest
from align.families.edit_common import SOURCE_KEY, source_images, split_edit_prompts
from align.families.flux import pack_latents, unpack_latents
from align.families.qwenimage import QwenImage

SOURCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, the source's ratio)
NEGATIVE_KEYS = ("negative_prompt_embeds", "negative_prompt_embeds_mask")  # the negative prompt on the row's source
UNCONDITIONAL_KEY = "unconditional"  # [B] 1 where the row is the unconditional side: the negative prompt, not its own
# Qwen2.5-VL's published image processor (Qwen-Image-Edit's processor/preprocessor_config.json): the planner's
# fallback where the model's own processor config cannot be read
PUBLISHED_PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384, "patch_size": 14, "temporal_patch_size": 2,
                       "merge_size": 2}


def source_side() -> int:
    """The side in pixels of a square source as QwenImageEditPipeline resizes it (looked up in the pipeline's module at
    each call, so that the family and the pipeline size sources with the one function)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    width, _, _ = pipeline_qwenimage_edit.calculate_dimensions(SOURCE_AREA, 1.0)
    return int(width)


def image_only_processor(model: str):
    """The pipeline's Qwen2VLProcessor without its video processor (which transformers builds only with torchvision):
    a subclass whose sub-processors leave it out, as rewards.vlm loads the VLM judges' processors."""
    from transformers import Qwen2VLProcessor

    attributes = [name for name in Qwen2VLProcessor.get_attributes() if name != "video_processor"]
    image_only = type("Qwen2VLProcessor", (Qwen2VLProcessor,), {  # the pipeline's config still names transformers' class
        "get_attributes": classmethod(lambda cls: list(attributes)), "__module__": Qwen2VLProcessor.__module__})
    path = Path(model).expanduser()
    if path.is_dir():
        return image_only.from_pretrained(str(path / "processor"))
    return image_only.from_pretrained(model, subfolder="processor")


def image_processor_of(model: str | None):
    """The pipeline's image processor from a local pipeline folder's config, else Qwen2.5-VL's published one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(model).expanduser() / "processor" if model else None
    if folder is not None and (folder / "preprocessor_config.json").is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    return Qwen2VLImageProcessorPil(**PUBLISHED_PROCESSOR)


class QwenImageEdit(QwenImage):
    name = "qwenimage-edit"
    title = "Qwen-Image-Edit"
    pipeline_class_names = ("QwenImageEditPipeline",)
    edits = True

    def pipeline_class(self):
        from diffusers import QwenImageEditPipeline

        return QwenImageEditPipeline

    # --- loading ------------------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        pipe = self.pretrained_with_processor(model, dtype, quantization, image_only_processor)
        if pipe.transformer.config.guidance_embeds:
            raise ModelLoadError(f"{model!r}: a guidance-distilled {self.title} transformer (guidance_embeds) is not "
                                 "supported; Qwen-Image-Edit's own transformer guides with two calls")
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    # --- conditioning -------------------------------------------------------------------------
    def sources(self, sources: list[str]) -> list:
        """The source images as the pipeline sizes them (square RGB PIL images)."""
        return source_images(sources, source_side())

    def encode_with_images(self, pipe, texts: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``pipe.encode_prompt`` of each text with its image (the edit template), and the mask of its real tokens."""
        embeds, mask = pipe.encode_prompt(list(texts), image=images, device=pipe.text_encoder.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """Each instruction with its source through the text encoder, the negative prompt on the same source, the
        source's latents, and the ``unconditional`` flag (a dropped instruction). The empty prompts (the trainers'
        unconditional side) are the flag alone; any other plain prompt is refused."""
        instructions, sources = split_edit_prompts(prompts, self.title)
        if sources is None:
            if any(prompt.strip() for prompt in prompts):
                raise ValueError(f"{self.title} edits: give prompts '[source: <image>] <instruction>', got "
                                 f"{next(p for p in prompts if p.strip())[:60]!r}")
            return {UNCONDITIONAL_KEY: torch.ones(len(prompts), dtype=torch.long, device=pipe.text_encoder.device)}
        side = source_side()
        # as QwenImageEditPipeline.__call__: resize (a no-op on a list), the text encoder sees the images, the VAE
        # their preprocessed pixels
        images = pipe.image_processor.resize(self.sources(sources), side, side)
        embeds, mask = self.encode_with_images(pipe, [i or self.negative_prompt for i in instructions], images)
        negative, negative_mask = self.encode_with_images(pipe, [self.negative_prompt] * len(prompts), images)
        pixels = pipe.image_processor.preprocess(images, side, side)
        dropped = torch.tensor([not i for i in instructions], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, NEGATIVE_KEYS[0]: negative,
                NEGATIVE_KEYS[1]: negative_mask, SOURCE_KEY: self.encode_images(pipe, pixels), UNCONDITIONAL_KEY: dropped}

    def resolved(self, cond: Conditioning) -> Conditioning:
        """``prompt_embeds`` (and mask) of each row flagged ``unconditional`` replaced by its negative prompt's."""
        flags = cond.get(UNCONDITIONAL_KEY)
        if flags is None or not bool(flags.any()):
            return cond
        if NEGATIVE_KEYS[0] not in cond:
            raise ValueError(f"{self.title}: the unconditional side needs the source of each row (edit prompts)")
        if bool(flags.all()):
            return {**cond, "prompt_embeds": cond[NEGATIVE_KEYS[0]], "prompt_embeds_mask": cond[NEGATIVE_KEYS[1]]}
        rows = flags.bool()
        own, negative = pad_to_longest([cond["prompt_embeds"], cond[NEGATIVE_KEYS[0]]])
        own_mask, negative_mask = pad_to_longest([cond["prompt_embeds_mask"], cond[NEGATIVE_KEYS[1]]])
        return {**cond, "prompt_embeds": torch.where(rows[:, None, None], negative, own),
                "prompt_embeds_mask": torch.where(rows[:, None], negative_mask, own_mask)}

    # --- shapes from the config files alone ---------------------------------------------------------
    def source_latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        """The pipeline's source size whatever the run's resolution."""
        return self.latent_shape_of(denoiser_config, vae_config, source_side())

    def text_tokens(self, model: str | None = None) -> int:
        """The prompt's tokens and the source's image tokens among them (the processor's patches, merged 2x2)."""
        processor, side = image_processor_of(model), source_side()
        image_tokens = processor.get_number_of_image_patches(side, side, {}) // processor.merge_size ** 2
        return super().text_tokens(model) + image_tokens

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity [B, C, H, W] on the generated tokens: the latents' 2x2 tokens, then the source's, with the
        two grids in ``img_shapes`` as the pipeline passes them."""
        source = cond.get(SOURCE_KEY)
        if source is None:
            return super().predict(denoiser, latents, timesteps, cond)
        batch, _, height, width = latents.shape
        img_shapes = [[(1, height // 2, width // 2), (1, source.shape[2] // 2, source.shape[3] // 2)]] * batch
        tokens = torch.cat([pack_latents(latents), pack_latents(source.to(latents.dtype))], dim=1)
        out = self.transformer_call(denoiser, tokens, timesteps, self.resolved(cond), img_shapes)
        return unpack_latents(out[:, : (height // 2) * (width // 2)], height, width)

    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        """As QwenImageEditPipeline: the unconditional call is the negative prompt on each row's own source (``uncond``,
        the trainers' shared rows, is not needed)."""
        if SOURCE_KEY in cond:
            flags = torch.ones(latents.shape[0], dtype=torch.long, device=latents.device)
            uncond = {**cond, UNCONDITIONAL_KEY: flags}
        return super().guided_prediction(denoiser, latents, timesteps, cond, uncond, guidance_scale)

    def call_arguments(self, pipe, prompts: list[str], guidance_scale: float, resolution: int | None = None) -> dict:
        """The sources at the pipeline's own size, the instructions (a dropped one: the negative prompt), and true CFG
        with the negative prompt. The generated size is the callers' ``height``/``width`` (the run's side)."""
        instructions, sources = split_edit_prompts(prompts, self.title)
        if sources is None:
            raise ValueError(f"{self.title} edits: give prompts '[source: <image>] <instruction>'")
        texts = [i or self.negative_prompt for i in instructions]
        return {"image": self.sources(sources), **super().call_arguments(pipe, texts, guidance_scale, resolution)}

