"""Qwen-Image-Edit-Plus (the pipeline of Qwen-Image-Edit-2509 and -2511): Qwen-Image-Edit (align/families/
qwenimage_edit.py) with the sources named in the prompt ("Picture 1: <|vision_start|>...<|vision_end|>" before the
instruction, inside a template without the image placeholder; its first 64 tokens dropped, as before) and two sizes of
each source: about 384 x 384 px for the Qwen2.5-VL text encoder, about 1024 x 1024 px for the VAE.

Matches diffusers' QwenImageEditPlusPipeline for one source per prompt: the template, the text encoder's image resized
by the pipeline's image processor from the source as given (``calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)``), the
VAE's from the same source (``calculate_dimensions(VAE_IMAGE_SIZE, ratio)``), its posterior mode normalised with the
VAE's latents_mean/std and packed into 2x2 tokens appended after the generated image's, ``img_shapes`` listing both grids,
and everything Qwen-Image-Edit matches (the σ schedule of the generated tokens, true CFG on two calls with the negative
prompt encoded on the same source). Qwen-Image-Edit's deliberate differences hold here too (the source at the
pipeline's size whatever the run's, sources loaded square, the negative prompt " ", a dropped instruction is that
negative prompt, the empty prompt is the ``unconditional`` flag, no video processor without torchvision). And:

- one source per prompt. The pipeline takes several sources for one prompt (Picture 1, Picture 2, ..., their latents
  concatenated, one grid each in ``img_shapes``); the project's edit prompts (``rewards.edit_prompts``) carry one
  source, so several sources per prompt are not supported.
- batches. The pipeline refuses more than one prompt per call (and would read a list of images as the sources of one
  prompt); the family loads it as the same class with a ``__call__`` that runs a batch one prompt at a time (prompt i
  with image i, its generator and its row of ``latents``), as the pipeline's error asks, so that AI feedback,
  evaluation and best-of-N call it as any other pipeline. The family itself encodes and predicts whole batches (each
  prompt encoded alone, zero-padded to the batch's longest with its mask, as Qwen-Image's families pad).
- the planner counts the text encoder's image tokens of the ~384 px source (the processor's patches merged 2x2), not
  Qwen-Image-Edit's ~1024 px one.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from align.families.base import pad_to_longest
from align.families.edit_common import SOURCE_KEY, source_images, split_edit_prompts
from align.families.qwenimage import QwenImage
from align.families.qwenimage_edit import NEGATIVE_KEYS, UNCONDITIONAL_KEY, QwenImageEdit, image_processor_of


def _square_side(area_name: str) -> int:
    """The side of a square source for the pipeline's area ``area_name``, with the pipeline module's own function and
    constant (looked up at each call, so that the family and the pipeline size sources alike)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    width, _ = plus.calculate_dimensions(getattr(plus, area_name), 1.0)
    return int(width)


def vae_side() -> int:
    """The side of the VAE's (and the family's ``source_latents``') square source: about 1024 px."""
    return _square_side("VAE_IMAGE_SIZE")


def condition_side() -> int:
    """The side of the text encoder's square source: about 384 px."""
    return _square_side("CONDITION_IMAGE_SIZE")


@functools.cache
def batching_pipeline_class():
    """QwenImageEditPlusPipeline (same name, same loaders and saving) whose ``__call__`` runs a batch of prompts one
    prompt at a time, prompt i with source i; one prompt goes to the pipeline unchanged (several sources included)."""
    from diffusers import QwenImageEditPlusPipeline

    def __call__(self, image=None, prompt=None, **kwargs):
        if not isinstance(prompt, list) or len(prompt) <= 1:
            return QwenImageEditPlusPipeline.__call__(self, image=image, prompt=prompt, **kwargs)
        count = len(prompt)
        if not isinstance(image, list) or len(image) != count:
            raise ValueError(f"QwenImageEditPlusPipeline: a batch of {count} prompts takes one source image each; "
                             "several sources for one prompt go one prompt per call")
        return_dict = kwargs.pop("return_dict", True)
        outputs = [QwenImageEditPlusPipeline.__call__(self, image=[image[i]], prompt=[prompt[i]], return_dict=False,
                                                      **row_arguments(kwargs, i, count))[0] for i in range(count)]
        images = joined(outputs)
        if not return_dict:
            return (images,)
        from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput

        return QwenImagePipelineOutput(images=images)

    return type("QwenImageEditPlusPipeline", (QwenImageEditPlusPipeline,),
                {"__call__": __call__, "__module__": __name__, "__doc__": batching_pipeline_class.__doc__})


def row_arguments(kwargs: dict, row: int, count: int) -> dict:
    """The pipeline's keyword arguments for prompt ``row`` of ``count``: its negative prompt, and its generators and
    rows of ``latents`` (``num_images_per_prompt`` of each); the rest unchanged (one generator is drawn from prompt after
    prompt)."""
    per_prompt = int(kwargs.get("num_images_per_prompt") or 1)
    rows = slice(row * per_prompt, (row + 1) * per_prompt)
    out = dict(kwargs)
    if isinstance(kwargs.get("negative_prompt"), list):
        out["negative_prompt"] = [kwargs["negative_prompt"][row]]
    for key in ("generator", "latents"):
        value = kwargs.get(key)
        if isinstance(value, (list, torch.Tensor)):
            if len(value) != count * per_prompt:
                raise ValueError(f"QwenImageEditPlusPipeline: {key} has {len(value)} rows for {count} prompts")
            out[key] = value[rows]
    return out


def joined(outputs: list):
    """The images of each prompt's call, one batch again (PIL lists, tensors or arrays, as the output type gives)."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    if isinstance(outputs[0], np.ndarray):
        return np.concatenate(outputs)
    return [image for output in outputs for image in output]


class QwenImageEditPlus(QwenImageEdit):
    name = "qwenimage-edit-plus"
    title = "Qwen-Image-Edit-Plus"
    pipeline_class_names = ("QwenImageEditPlusPipeline",)

    def pipeline_class(self):
        return batching_pipeline_class()

    # --- conditioning -------------------------------------------------------------------------
    def sources(self, sources: list[str]) -> list:
        """The source images at the VAE's size (square RGB PIL images): what ``call_arguments`` hands the pipeline,
        which resizes them for the text encoder itself."""
        return source_images(sources, vae_side())

    def encode_with_images(self, pipe, texts: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``pipe.encode_prompt`` of each text alone with its one image (a list of images is one prompt's sources:
        "Picture 1", "Picture 2", ...), zero-padded to the longest with the mask of the real tokens."""
        rows = [QwenImageEdit.encode_with_images(self, pipe, [text], [image]) for text, image in zip(texts, images)]
        embeds = torch.cat(pad_to_longest([embed for embed, _ in rows]))
        return embeds, torch.cat(pad_to_longest([mask for _, mask in rows]))

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None):
        """As Qwen-Image-Edit, with the text encoder seeing each source at ~384 px and the VAE at ~1024 px, both resized
        from the source as loaded, as QwenImageEditPlusPipeline.__call__ does."""
        instructions, sources = split_edit_prompts(prompts, self.title)
        if sources is None:  # the empty prompts' ``unconditional`` flag, or the one-line refusal
            return super().encode_prompts(pipe, prompts, resolution)
        images, side = self.sources(sources), condition_side()
        shown = [pipe.image_processor.resize(image, side, side) for image in images]
        embeds, mask = self.encode_with_images(pipe, [i or self.negative_prompt for i in instructions], shown)
        negative, negative_mask = self.encode_with_images(pipe, [self.negative_prompt] * len(prompts), shown)
        pixels = pipe.image_processor.preprocess(images, vae_side(), vae_side())
        dropped = torch.tensor([not i for i in instructions], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, NEGATIVE_KEYS[0]: negative,
                NEGATIVE_KEYS[1]: negative_mask, SOURCE_KEY: self.encode_images(pipe, pixels), UNCONDITIONAL_KEY: dropped}

    # --- shapes from the config files alone ---------------------------------------------------------
    def source_latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        return self.latent_shape_of(denoiser_config, vae_config, vae_side())

    def text_tokens(self, model: str | None = None) -> int:
        """The prompt's tokens and the ~384 px source's image tokens among them (the processor's patches, merged 2x2)."""
        processor, side = image_processor_of(model), condition_side()
        image_tokens = processor.get_number_of_image_patches(side, side, {}) // processor.merge_size ** 2
        return QwenImage.text_tokens(self, model) + image_tokens
