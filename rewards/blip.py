"""BLIP image-text matching (MJ-Bench's "BLIP" judge) on transformers' BlipForImageTextRetrieval.

Score: the ITM head's probability that image and text match, softmax(itm_logits)[:, 1]
(index 1 is "match"; MJ-Bench's script read index 0, the no-match logit, by mistake).
Preprocessing is the checkpoint's own processor (384 px, bicubic, CLIP mean/std for
Salesforce/blip-itm-base-coco); prompts are cut at 35 tokens, BLIP's ITM limit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.base import Judge
from rewards.images import Images, num_images, to_pil
from rewards.weights import check_batch_size, check_prompts, missing, resolve_device, resolve_dtype

BLIP_ITM = "Salesforce/blip-itm-base-coco"
BLIP_ITM_MAX_TOKENS = 35  # BLIP's blip_itm.py tokenizes with max_length=35


def blip_text_cls(model, pixel_values, input_ids, attention_mask) -> torch.Tensor:
    """[N, D] [CLS] state of BLIP's text encoder cross-attending to the image tokens.

    The steps of BlipForImageTextRetrieval.forward(use_itm_head=True) before the ITM head, with the
    image attention mask made on the image tokens' device.
    """
    image = model.vision_model(pixel_values=pixel_values).last_hidden_state
    image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
    text = model.text_encoder(
        input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image, encoder_attention_mask=image_mask
    ).last_hidden_state
    return text[:, 0]


class BlipItm(Judge):
    """P(match) from BLIP's image-text matching head."""

    def __init__(
        self,
        model: str | Path = BLIP_ITM,
        processor: str | Path | None = None,
        device=None,
        dtype=None,
        batch_size: int = 32,
        tie_margin: float = 0.0,
        max_tokens: int = BLIP_ITM_MAX_TOKENS,
    ):
        from transformers import AutoConfig, AutoProcessor, BlipForImageTextRetrieval

        super().__init__(name="blip", tie_margin=tie_margin)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.batch_size = check_batch_size(batch_size)
        self.max_tokens = max_tokens
        try:
            config = AutoConfig.from_pretrained(str(model))
        except (OSError, ValueError) as err:
            raise missing("blip", str(model), err) from err
        if config.model_type != "blip":
            raise ValueError(
                f"judge 'blip': {str(model)!r} holds a {config.model_type!r} model; a BLIP image-text "
                f"retrieval model (model_type 'blip', e.g. {BLIP_ITM}) is needed"
            )
        source = str(processor or model)
        try:
            # the PIL image backend with or without torchvision (rewards.clip.load_processor says why)
            self.processor = AutoProcessor.from_pretrained(source, backend="pil")
        except (OSError, ValueError) as err:
            raise missing("blip", source, err, what="processor") from err
        try:
            self.model = BlipForImageTextRetrieval.from_pretrained(str(model), dtype=self.dtype)
        except OSError as err:
            raise missing("blip", str(model), err) from err
        self.model.to(self.device).eval()

    @torch.no_grad()
    def match_logits(self, prompts: list[str], images: Images) -> torch.Tensor:
        """[N, 2] ITM logits (no-match, match), computed batch by batch."""
        prompts = check_prompts(prompts, num_images(images), self.name)
        pil = to_pil(images)
        out = []
        for start in range(0, len(pil), self.batch_size):
            chunk = pil[start : start + self.batch_size]
            texts = prompts[start : start + self.batch_size]
            pixels = self.processor.image_processor(images=chunk, return_tensors="pt")["pixel_values"]
            tokens = self.processor.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
            )
            out.append(self._itm(pixels, tokens["input_ids"], tokens["attention_mask"]).float().cpu())
        return torch.cat(out) if out else torch.empty(0, 2)

    def _itm(self, pixels, input_ids, attention_mask) -> torch.Tensor:
        cls = blip_text_cls(self.model, pixels.to(self.device, self.dtype), input_ids.to(self.device), attention_mask.to(self.device))
        return self.model.itm_head(cls)

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        return torch.softmax(self.match_logits(prompts, images), dim=-1)[:, 1]

    def __repr__(self) -> str:
        return f"BlipItm(name={self.name!r}, max_tokens={self.max_tokens}, tie_margin={self.tie_margin})"

