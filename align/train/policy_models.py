"""The denoiser as the online-RL objectives see it: the trained policy (with gradient, through accelerate's wrapper),
the reference (the adapter off, or a frozen copy) and the old policy (DiffusionNFT, AWM), each as the guided
prediction the sampler uses (``PolicyPredictions`` of align/train/objectives/base.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from align.families.base import ModelFamily, guided_prediction
from align.pipeline import disabled_adapter, merged_adapter
from align.train.old_policy import OldPolicy
from align.train.sharding import is_sharded


@dataclass
class PolicyModels:
    family: ModelFamily
    denoiser: torch.nn.Module  # the bare denoiser (the trained one's module)
    trained: torch.nn.Module  # the denoiser as accelerate prepared it: its forward computes the gradient
    reference: torch.nn.Module | None  # a frozen copy (full fine-tuning), or None: the adapter off
    old: OldPolicy | None
    guidance_scale: float
    autocast: Callable  # the accelerator's autocast
    samples_with_old_policy: bool = False  # the old policy draws the rollouts (DiffusionNFT)
    merge_lora: bool = False  # sample with the LoRA folded into the weights (sampling_merges_lora)

    def predict(self, latents, timesteps, cond, uncond, which: str = "policy",
                guidance_scale: float | None = None) -> torch.Tensor:
        def guided(model):
            scale = self.guidance_scale if guidance_scale is None or self.family.uses_guidance_embedding(model) \
                else guidance_scale
            with self.autocast():
                return guided_prediction(self.family, model, latents, timesteps, cond, uncond, scale)

        if which == "policy":
            return guided(self.trained)
        with torch.no_grad():
            if which == "old":
                with self.old.swapped_in():
                    return guided(self.denoiser)
            if self.reference is not None:
                return guided(self.reference)
            with disabled_adapter(self.denoiser):
                return guided(self.denoiser)

    @contextlib.contextmanager
    def sampling(self):
        """The policy that samples: the old one where the objective keeps one, else the trained one; with LoRA folded
        into the weights when that computes what the training forward does (``merge_lora``)."""
        with self.old.swapped_in() if self.samples_with_old_policy else contextlib.nullcontext():
            with merged_adapter(self.denoiser) if self.merge_lora else contextlib.nullcontext():
                yield self.denoiser


def sampling_merges_lora(config, accelerator=None) -> bool:
    """Sample with the LoRA folded into the weights (~12% faster on the testbed) when that computes what the
    training forward does: in fp32 up to rounding; not under fp16/bf16 (the rounding differs, the first
    minibatch would be off-policy and PPO would clip it), nor under FSDP2 (the weights are shards between forwards)."""
    return config.mixed_precision == "no" and not (accelerator is not None and is_sharded(accelerator))
