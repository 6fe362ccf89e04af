"""CLIP-family judges on one code path: CLIPScore, PickScore, the LAION aesthetic predictor
and the testbed's shapes-clip.

All of them embed images (and, except the aesthetic predictor, prompts) with a
``transformers.CLIPModel`` and its saved processor, so each model's own preprocessing
(resize, crop, normalisation, 77-token limit, or the testbed's 32 px) comes from its folder.

| judge       | weights                                   | score                                     |
|-------------|-------------------------------------------|-------------------------------------------|
| clip        | openai/clip-vit-large-patch14             | cos(image, text); variant="clip-s": 2.5*max(cos, 0) |
| pickscore   | yuvalkirstain/PickScore_v1 + CLIP-H processor | logit_scale.exp() * cos (PickScore's own code) |
| aesthetic   | CLIP ViT-L/14 + sac+logos+ava1-l14-linearMSE MLP | MLP(normalised image embedding), ~1-10 |
| shapes-clip | rewards/weights/shapes-clip (testbed)     | cos(image, text)                          |
"""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.base import Judge
from rewards.checkpoint_keys import ScoreMLP, aesthetic_mlp_keys
from rewards.differentiable import check_image_tensor, processor_pixels, resize_and_crop
from rewards.images import Images, num_images, to_pil
from rewards.preprocess import openai_clip_pixels
from rewards.weights import (
    MissingWeightsError,
    batched,
    check_batch_size,
    check_prompts,
    load_state_dict,
    missing,
    offline_hint,
    resolve_device,
    resolve_dtype,
    resolve_file,
)

CLIP_L14 = "openai/clip-vit-large-patch14"
PICKSCORE = "yuvalkirstain/PickScore_v1"
CLIP_H14_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
SHAPES_CLIP_FOLDER = Path(__file__).resolve().parent / "weights" / "shapes-clip"
# The LAION aesthetic predictor v2 head is published in the authors' GitHub repository only.
AESTHETIC_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
    "sac%2Blogos%2Bava1-l14-linearMSE.pth"
)
AESTHETIC_FILENAME = "sac+logos+ava1-l14-linearMSE.pth"
CLIP_S_WEIGHT = 2.5  # CLIPScore (Hessel et al., 2021): 2.5 * max(cos, 0)
VARIANTS = ("cosine", "clip-s", "scaled")


class ClipEmbedder:
    """A CLIPModel and its processor: L2-normalised image and text embeddings, in batches."""

    def __init__(self, model, processor, device: torch.device, dtype: torch.dtype, batch_size: int, pixel_fn=None,
                 clean_text=None, tensor_pixel_fn=None):
        # a judge: its weights never train (the differentiable path needs gradients for the pixels only)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.processor = processor
        # pixel_fn(list of PIL images) -> [N, 3, H, W]; default: the processor's image preprocessing
        self.pixel_fn = pixel_fn or (lambda imgs: processor.image_processor(images=imgs, return_tensors="pt")["pixel_values"])
        # tensor_pixel_fn(float [N, 3, H, W] in [0, 1]) -> [N, 3, h, w] with gradients: the same steps on the tensor
        self.tensor_pixel_fn = tensor_pixel_fn or processor_pixels(processor.image_processor)
        # clean_text(caption) -> caption, before the tokenizer (e.g. open_clip's cleaning for HPS)
        self.clean_text = clean_text
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        text_config = model.config.text_config
        tokenizer = getattr(processor, "tokenizer", None)
        limit = getattr(tokenizer, "model_max_length", None) or text_config.max_position_embeddings
        # 77 for every real CLIP; never more than the position table holds
        self.max_tokens = min(int(limit), text_config.max_position_embeddings)

    @classmethod
    def load(
        cls,
        model: str | Path,
        processor: str | Path | None = None,
        *,
        device=None,
        dtype=None,
        batch_size: int = 32,
        judge: str = "clip",
    ) -> ClipEmbedder:
        """A CLIPModel from a hub id or folder; the processor from ``processor`` or the same place."""
        from transformers import AutoConfig, CLIPModel

        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        check_batch_size(batch_size)
        try:
            config = AutoConfig.from_pretrained(str(model))
        except (OSError, ValueError) as err:
            raise missing(judge, str(model), err) from err
        check_clip_config(config, str(model), judge)
        proc = load_processor(str(processor or model), judge)
        try:
            clip = CLIPModel.from_pretrained(str(model), dtype=dtype)
        except OSError as err:
            raise missing(judge, str(model), err) from err
        return cls(clip, proc, device, dtype, batch_size)

    @torch.no_grad()
    def image_embeddings(self, images: Images) -> torch.Tensor:
        """[N, D] float32, unit norm."""
        pil = to_pil(images)
        out = []
        for chunk in batched(pil, self.batch_size):
            pixels = self.pixel_fn(chunk)
            # transformers 5 returns an output object; the projected embedding is pooler_output
            feats = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)).pooler_output
            out.append(torch.nn.functional.normalize(feats.float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.empty(0, self.model.config.projection_dim)

    def image_embeddings_differentiable(self, images: torch.Tensor) -> torch.Tensor:
        """[N, D] float32, unit norm, differentiable with respect to ``images`` (float [N, 3, H, W] in [0, 1]), on the
        images' device; one forward pass (the caller batches)."""
        pixels = self.tensor_pixel_fn(images).to(self.device, self.dtype)
        feats = self.model.get_image_features(pixel_values=pixels).pooler_output
        return torch.nn.functional.normalize(feats.float(), dim=-1).to(images.device)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """[N, D] float32, unit norm; each distinct prompt is encoded once."""
        unique = list(dict.fromkeys(prompts))
        out = []
        for chunk in batched(unique, self.batch_size):
            if self.clean_text is not None:
                chunk = [self.clean_text(p) for p in chunk]
            tokens = self.processor.tokenizer(
                chunk, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
            )
            feats = self.model.get_text_features(
                input_ids=tokens["input_ids"].to(self.device),
                attention_mask=tokens["attention_mask"].to(self.device),
            ).pooler_output
            out.append(torch.nn.functional.normalize(feats.float(), dim=-1).cpu())
        table = torch.cat(out) if out else torch.empty(0, self.model.config.projection_dim)
        index = {p: i for i, p in enumerate(unique)}
        return table[[index[p] for p in prompts]] if prompts else table

    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())


def check_clip_config(config, source: str, judge: str) -> None:
    if config.model_type != "clip":
        raise ValueError(
            f"judge {judge!r}: {source!r} holds a {config.model_type!r} model; a CLIP model "
            f"(transformers CLIPModel, model_type 'clip') is needed"
        )


def load_processor(source: str, judge: str):
    """The saved processor, with transformers' PIL image backend whether or not torchvision is
    installed: with torchvision, transformers 5 would pick its torchvision processors, whose resize
    moves pixels by up to 0.029 (PickScore by 2.8e-4), so a score would depend on the environment.
    The PIL backend is the one the authors' code ran (transformers' CLIPImageProcessor of 2023)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(source, backend="pil")
    except (OSError, ValueError) as err:
        raise missing(judge, source, err, what="processor (tokenizer + image preprocessing)") from err


class ClipSimilarity(Judge):
    """Image-text similarity of a CLIP model (clip, pickscore, shapes-clip)."""

    def __init__(self, embedder: ClipEmbedder, name: str, variant: str = "cosine", tie_margin: float = 0.0):
        if variant not in VARIANTS:
            raise ValueError(f"judge {name!r}: unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
        super().__init__(name=name, tie_margin=tie_margin)
        self.embedder = embedder
        self.variant = variant

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        prompts = check_prompts(prompts, num_images(images), self.name)
        cos = (self.embedder.image_embeddings(images) * self.embedder.text_embeddings(prompts)).sum(-1)
        return clip_similarity(cos, self.variant, self.embedder.logit_scale())

    def score_differentiable(self, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
        """The score of ``score`` with gradients flowing back to the pixels (rewards/differentiable.py): [N] float32."""
        images = check_image_tensor(images, f"{self.name}.score_differentiable: images")
        prompts = check_prompts(prompts, images.shape[0], self.name)
        text = self.embedder.text_embeddings(prompts).to(images.device)
        cos = (self.embedder.image_embeddings_differentiable(images) * text).sum(-1)
        return clip_similarity(cos, self.variant, self.embedder.logit_scale())

    def __repr__(self) -> str:
        return f"ClipSimilarity(name={self.name!r}, variant={self.variant!r}, tie_margin={self.tie_margin})"


def clip_similarity(cos: torch.Tensor, variant: str, logit_scale: float) -> torch.Tensor:
    """The score from cosine similarities: plain, CLIP-S (2.5*max(cos,0)), or PickScore's scaled form."""
    if variant == "cosine":
        return cos
    if variant == "clip-s":
        return CLIP_S_WEIGHT * cos.clamp(min=0)
    if variant == "scaled":
        return logit_scale * cos
    raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")


class AestheticPredictor(Judge):
    """LAION aesthetic predictor v2: an MLP on the normalised CLIP ViT-L/14 image embedding.

    The prompt is ignored (the predictor rates the image alone).
    """

    def __init__(self, embedder: ClipEmbedder, mlp: ScoreMLP, name: str = "aesthetic", tie_margin: float = 0.0):
        super().__init__(name=name, tie_margin=tie_margin)
        self.embedder = embedder
        self.mlp = mlp.float().eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        check_prompts(prompts, num_images(images), self.name)
        return self.mlp(self.embedder.image_embeddings(images)).squeeze(-1)

    def score_differentiable(self, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
        """The score of ``score`` with gradients flowing back to the pixels: [N] float32 (the head on their device)."""
        images = check_image_tensor(images, f"{self.name}.score_differentiable: images")
        check_prompts(prompts, images.shape[0], self.name)
        embeddings = self.embedder.image_embeddings_differentiable(images)
        return self.mlp.to(embeddings.device)(embeddings).squeeze(-1)

    def __repr__(self) -> str:
        return f"AestheticPredictor(name={self.name!r}, tie_margin={self.tie_margin})"


def load_aesthetic_mlp(source: str | Path, input_size: int, filename: str = AESTHETIC_FILENAME) -> ScoreMLP:
    """The predictor head from a URL, a local .pth/.safetensors file or folder, or a hub repo."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        cached = Path(torch.hub.get_dir()) / "checkpoints" / filename
        if offline_hint() and not cached.is_file():
            raise missing("aesthetic", text, f"not in the torch hub cache ({cached})")
        try:
            state = torch.hub.load_state_dict_from_url(
                text, map_location="cpu", weights_only=True, file_name=filename, progress=False
            )
        except Exception as err:  # URLError, HTTPError, ...: all mean "not available here"
            raise missing("aesthetic", text, err) from err
    else:
        state = load_state_dict(resolve_file(source, filename, "aesthetic"), "aesthetic")
    mlp = ScoreMLP(input_size)
    mapped = aesthetic_mlp_keys(state)
    first = mapped.get("layers.0.weight")
    if first is not None and first.shape[1] != input_size:
        raise ValueError(
            f"judge 'aesthetic': the predictor head expects {first.shape[1]}-d image embeddings but the "
            f"CLIP model gives {input_size}-d; the LAION v2 head needs CLIP ViT-L/14 (768-d)"
        )
    mlp.load_state_dict(mapped, strict=True)
    return mlp


# --- factories registered in rewards/__init__.py ----------------------------------------------

def clip_score(
    model: str = CLIP_L14,
    processor: str | None = None,
    variant: str = "cosine",
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> ClipSimilarity:
    """CLIPScore: cosine of normalised CLIP image/text embeddings (variant='clip-s' for 2.5*max(cos,0))."""
    _check_variant("clip", variant)
    embedder = ClipEmbedder.load(model, processor, device=device, dtype=dtype, batch_size=batch_size, judge="clip")
    return ClipSimilarity(embedder, "clip", variant, tie_margin)


def pickscore(
    model: str = PICKSCORE,
    processor: str = CLIP_H14_PROCESSOR,
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> ClipSimilarity:
    """PickScore v1: logit_scale.exp() * cos, with the CLIP-H processor as its authors use it."""
    embedder = ClipEmbedder.load(model, processor, device=device, dtype=dtype, batch_size=batch_size, judge="pickscore")
    return ClipSimilarity(embedder, "pickscore", "scaled", tie_margin)


def shapes_clip(
    model: str | Path = SHAPES_CLIP_FOLDER,
    variant: str = "cosine",
    device=None,
    dtype=None,
    batch_size: int = 64,
    tie_margin: float = 0.0,
) -> ClipSimilarity:
    """The testbed's tiny CLIP (32 px, its own tokenizer), trained on the shapes world."""
    _check_variant("shapes-clip", variant)
    if Path(model) == SHAPES_CLIP_FOLDER and not SHAPES_CLIP_FOLDER.is_dir():
        raise MissingWeightsError(
            f"judge 'shapes-clip': the testbed weights are not built yet (expected the folder "
            f"{SHAPES_CLIP_FOLDER}); build them with the testbed scripts or pass model=<folder>"
        )
    embedder = ClipEmbedder.load(
        model, None, device=device or "cpu", dtype=dtype, batch_size=batch_size, judge="shapes-clip"
    )
    return ClipSimilarity(embedder, "shapes-clip", variant, tie_margin)


def aesthetic(
    model: str | Path = AESTHETIC_URL,
    clip_model: str = CLIP_L14,
    filename: str = AESTHETIC_FILENAME,
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> AestheticPredictor:
    """LAION aesthetic predictor v2 (sac+logos+ava1-l14-linearMSE) on CLIP ViT-L/14.

    ``model`` is the predictor head (URL, .pth/.safetensors file, folder or hub repo holding
    ``filename``); ``clip_model`` the CLIP it reads embeddings from.
    """
    embedder = ClipEmbedder.load(clip_model, None, device=device, dtype=dtype, batch_size=batch_size, judge="aesthetic")
    # the authors embed with OpenAI CLIP's own preprocessing (torchvision's rounding centre crop)
    size = embedder.model.config.vision_config.image_size
    mean, std = embedder.processor.image_processor.image_mean, embedder.processor.image_processor.image_std
    embedder.pixel_fn = lambda imgs: openai_clip_pixels(imgs, size, mean, std)
    embedder.tensor_pixel_fn = lambda images: resize_and_crop(images, size, (size, size), mean, std, rounded=True)
    mlp = load_aesthetic_mlp(model, embedder.model.config.projection_dim, filename)
    # the head stays on the CPU in float32: embeddings come back there, and it is tiny
    return AestheticPredictor(embedder, mlp, tie_margin=tie_margin)


def _check_variant(judge: str, variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"judge {judge!r}: unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
