"""DRaFT-K (Clark, Vicol, Swersky and Fleet, "Directly Fine-Tuning Diffusion Models on Differentiable Rewards", ICLR
2024): sample with the trained model, backpropagate the reward of the image through the last K steps of the chain.

The authors published no code. The reading followed is the paper's Algorithm 1 with its truncation (Section 4.1):
the chain runs from x_T ~ N(0, I); the gradient of r(x_0, c) flows to the weights through the last K steps only (the
latents before them are stop-gradient), every step sampled with the classifier-free-guided prediction; the update
ascends the reward (loss -r, averaged over the batch). K = 1 ("DRaFT-1") is the paper's most efficient setting and
the default; K = the number of steps is full DRaFT (with --gradient_checkpointing for memory). The paper samples with
50 DDIM steps (deterministic, η = 0: ``--sampler ode``) at guidance 7.5 on Stable Diffusion 1.4 with LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import option
from align.declared import SAMPLING_STEPS
from align.train.backprop_sampling import truncated_sample
from align.train.objectives.backprop_common import (
    CURVES,
    chain_length,
    check_backprop_run,
    check_chain_length,
)
from align.train.objectives.base import Algorithm, BackpropObjective, Method


@dataclass
class DraftOptions:
    draft_k: int = option(1, "DRaFT-K's K: the last K steps of the chain carry the reward's gradient (the paper's "
                          "best: 1; every step: full DRaFT)", "--algorithm draft", within=SAMPLING_STEPS)

    def check(self) -> None:
        check_backprop_run(self, "draft")


class DRaFT(BackpropObjective):
    def __init__(self, k: int):
        self.k = k

    @classmethod
    def from_config(cls, sampler, config) -> DRaFT:
        check_chain_length("draft", config.draft_k, chain_length(sampler, "draft"))
        return cls(config.draft_k)

    @staticmethod
    def kept_forwards(config) -> int:
        return config.draft_k  # every backpropagated step's activations, until the backward

    def sample(self, sampler, predict, noise, generator):
        return truncated_sample(sampler, predict, noise, generator, self.k), {"backprop_steps": float(self.k)}

    def reward_loss(self, rewards):
        return -rewards.mean()

    def describe(self) -> str:
        return f"DRaFT-{self.k}: the reward's gradient through the last {self.k} step(s) of the chain"


ALGORITHM = Algorithm(
    name="draft",
    summary="DRaFT-K: reward backpropagation through the last K sampling steps (a differentiable judge)",
    method=Method("DRaFT-K", "Clark et al. 2024"),
    objective=DRaFT,
    options=DraftOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ode", "drop_zero_advantage": False},  # the paper: DDIM, deterministic
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=CURVES,
)
