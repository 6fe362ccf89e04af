"""ReFL (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
Reward Feedback Learning): run the chain without gradients to a random late step, take that step's x0 prediction
with gradients, decode it and backpropagate the reward through that one denoiser call.

Source: THUDM/ImageReward @ c1392c6 (ImageReward/ReFL.py ``Trainer.train``, ReFL_SDXL_LoRA.py ``_reward_loss``,
scripts/train_refl.sh); pinned against the authors' lines by experiments/reward_backprop_reference.py ->
tests/data/reward_backprop_reference.json.

- Chain: the model's DDPMScheduler, 40 steps, no classifier-free guidance; the step is ``random.randint(30, 39)``
  (one of the last 10), drawn once per batch; ``pred_original_sample`` of that step is decoded (VAE) and mapped to
  [0, 1]. DDPM ancestral sampling on DDIM's timesteps is DDIM with η = 1 (the same mean and variance), which is the
  default sampler here (``--sampler ddim --eta 1``).
- Loss: relu(2 - ImageReward) (no gradient once a reward passes 2), averaged over the batch, times grad_scale 1e-3.
- Authors' optimisation (SD 1.4, full fine-tuning): AdamW lr 1e-5, weight decay 1e-2, gradient norm 1, batch 2 per GPU
  x 4 accumulation x 8 GPUs = 64 images per step, 100 steps, EMA of the UNet, fp16; their SDXL script adds LoRA (rank 4,
  alpha 4) and mixes in a pretraining loss on real images (``--apply_pre_loss``, not here).

Where we differ: the reward's preprocessing is rewards/differentiable.py's (theirs: torchvision's Resize(224) of the
tensor, CenterCrop, Normalize; the same steps); no EMA and no pretraining loss; one guidance scale for training and the
held-out evaluation (--guidance_scale; the authors sample their training chain without guidance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import option
from align.declared import POSITIVE, SAMPLING_STEPS
from align.train.backprop_sampling import draw_refl_step, late_step_x0
from align.train.objectives.backprop_common import (
    CURVES,
    chain_length,
    check_backprop_run,
    check_chain_length,
)
from align.train.objectives.base import Algorithm, BackpropObjective, Method
from align.train.report import Curve


@dataclass
class ReFLOptions:
    refl_last_steps: int = option(10, "ReFL draws its step uniformly among the chain's last N steps (the authors: the "
                                  "last 10 of 40, random.randint(30, 39))", "--algorithm refl",
                                  within=SAMPLING_STEPS)
    refl_ceiling: float = option(2.0, "ReFL's loss is relu(ceiling - reward): no gradient from an image whose reward "
                                 "passes it (the authors: 2, on ImageReward's scale)", "--algorithm refl",
                                 within="[-1000000, 1000000]")
    refl_loss_scale: float = option(1e-3, "ReFL's grad_scale: the loss is multiplied by it (the authors: 1e-3)",
                                    "--algorithm refl", within=POSITIVE)

    def check(self) -> None:
        check_backprop_run(self, "refl")


def refl_loss(rewards: torch.Tensor, ceiling: float, scale: float) -> torch.Tensor:
    """The authors' ``F.relu(-rewards + 2).mean() * args.grad_scale`` with their 2 as ``ceiling``."""
    return torch.relu(ceiling - rewards).mean() * scale


class ReFL(BackpropObjective):
    def __init__(self, last_steps: int, ceiling: float, loss_scale: float):
        self.last_steps, self.ceiling, self.loss_scale = last_steps, ceiling, loss_scale

    @classmethod
    def from_config(cls, sampler, config) -> ReFL:
        check_chain_length("refl", config.refl_last_steps, chain_length(sampler, "refl"))
        return cls(config.refl_last_steps, config.refl_ceiling, config.refl_loss_scale)

    def sample(self, sampler, predict, noise, generator):
        stop = draw_refl_step(len(sampler.chain_timesteps()), self.last_steps, generator)
        return late_step_x0(sampler, predict, noise, generator, stop), {"refl_step": float(stop)}

    def reward_loss(self, rewards):
        return refl_loss(rewards, self.ceiling, self.loss_scale)

    def describe(self) -> str:
        return (f"x0 of a step among the last {self.last_steps}, loss {self.loss_scale:g} x relu({self.ceiling:g} - "
                "reward)")


ALGORITHM = Algorithm(
    name="refl",
    summary="ReFL: reward backpropagation through one late step's x0 prediction",
    method=Method("ReFL", "Xu et al. 2023"),
    objective=ReFL,
    options=ReFLOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ddim", "drop_zero_advantage": False},  # DDPM = DDIM with eta 1
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=(*CURVES, Curve("ReFL's step (index in the chain)", ("refl_step",))),
)
