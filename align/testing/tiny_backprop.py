"""Stand-ins for checking reward backpropagation's gradients against the authors' code (experiments/
reward_backprop_reference.py pins the authors' numbers, tests/test_reward_backprop_reference.py compares ours): a
denoiser, a decoder and a differentiable judge, each a few float64 parameters drawn from a seed, that accept both the
authors' calling conventions (``unet(x, t, embeds, cross_attention_kwargs=..., return_dict=False)[0]``, ``vae.decode(z,
return_dict=False)[0]``, ``reward_model.score_gard(ids, mask, pixels)``) and ours (``unet(x, t,
encoder_hidden_states=...).sample``, ``vae.decode(z).sample``, ``judge.score_differentiable(prompts, images)``).
Elementwise and small, so the numbers do not depend on matrix-multiplication kernels."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SCALING_FACTOR = 0.18215
TEXT_DIM = 6
# The DDIM/DDPM schedule of Stable Diffusion v1 (its scheduler_config.json), with the testbed's DDIM class.
SD_SCHEDULE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                   clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon",
                   timestep_spacing="leading")


class Output(tuple):
    """diffusers' model outputs: ``.sample`` and ``[0]`` alike."""

    @property
    def sample(self) -> torch.Tensor:
        return self[0]


def _randn(generator: torch.Generator, *shape, scale: float = 1.0, shift: float = 0.0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64) * scale + shift)


class TinyDenoiser(torch.nn.Module):
    """ε(x, t, c) = tanh(a·x + b·sin(t / 250) + W·mean(c)) per channel: every parameter gets a gradient."""

    def __init__(self, channels: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = _randn(g, channels, 1, 1, scale=0.2, shift=0.9)
        self.b = _randn(g, channels, 1, 1, scale=0.3)
        self.w = _randn(g, channels, TEXT_DIM, scale=0.3)
        self.config = SimpleNamespace(in_channels=channels, sample_size=8)

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    def forward(self, sample, timestep, encoder_hidden_states, cross_attention_kwargs=None, return_dict=True):
        t = torch.as_tensor(timestep, dtype=torch.float64, device=sample.device).reshape(-1, 1, 1, 1)
        text = (encoder_hidden_states.to(torch.float64).mean(1) @ self.w.T)[:, :, None, None]
        out = torch.tanh(self.a * sample.to(torch.float64) + self.b * torch.sin(t / 250) + text)
        return Output((out,))


class TinyDecoder(torch.nn.Module):
    """A VAE stand-in: 3 colour channels mixed from the latents, upsampled (bilinear) to ``size`` px, in about [-1, 1]."""

    def __init__(self, channels: int = 4, size: int = 224, seed: int = 1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.mix = _randn(g, 3, channels, scale=0.4)
        self.size = size
        self.config = SimpleNamespace(scaling_factor=SCALING_FACTOR, shift_factor=None, force_upcast=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.mix.dtype

    @property
    def device(self) -> torch.device:
        return self.mix.device

    def decode(self, latents, return_dict=True):
        mixed = torch.einsum("oc,bchw->bohw", self.mix, latents.to(torch.float64))
        out = torch.tanh(F.interpolate(mixed, size=(self.size, self.size), mode="bilinear", align_corners=False))
        return Output((out,))


def normalise(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CLIP_MEAN, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


class TinyJudge:
    """A differentiable judge on CLIP-normalised pixels: the mean of v·tanh(pixels) per image, plus a per-prompt offset
    (the prompt's length, so that prompts matter)."""

    def __init__(self, seed: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.v = torch.randn(3, 1, 1, generator=g, dtype=torch.float64)
        self.name = "tiny"

    def on_pixels(self, pixels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return (self.v * torch.tanh(pixels.to(torch.float64))).mean(dim=(1, 2, 3)) + 0.01 * lengths.to(torch.float64)

    def score_differentiable(self, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.float64)
        return self.on_pixels(normalise(images.to(torch.float64)), lengths)

    def score_gard(self, prompt_ids, prompt_attention_mask, image):
        """ImageReward's call: the same score, the prompt's length read off the attention mask's ids."""
        return self.on_pixels(image, prompt_ids.to(torch.float64))


def text_embeddings(batch: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt embeddings, the empty prompt's) [batch, 5, TEXT_DIM] float64."""
    g = torch.Generator().manual_seed(seed)
    positive = torch.randn(batch, 5, TEXT_DIM, generator=g, dtype=torch.float64)
    negative = torch.randn(1, 5, TEXT_DIM, generator=g, dtype=torch.float64).expand(batch, -1, -1).clone()
    return positive, negative


def gradient_vector(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened in registration order (float64)."""
    return torch.cat([p.grad.detach().reshape(-1).to(torch.float64) for p in module.parameters()])
