"""DRaFT-LV (Clark et al., ICLR 2024, Section 4.2): DRaFT-1 with a lower-variance gradient. The chain runs without
gradients to the image x_0; then n times, x_1 = α_1·x_0 + σ_1·ε (fresh noise to the last step's noise level) and the
sampler's last step from x_1 is taken again with gradients; the reward of those n images is backpropagated through
that one step. The extra images cost one denoiser call and one decode each, far less than sampling them.

The authors published no code. The reading followed is the paper's Algorithm 2 (n = 2 in its experiments): the
gradient is the mean over the n re-noised copies (the paper sums them; the mean only rescales the learning rate),
and the image the chain sampled is not scored itself. FlowBP (RuoyuWang-2077/FlowBP, flowbp/trainers/*/draft_lv.py)
reads it otherwise for flow models: it also backpropagates through the chain's own last step (n + 1 images).
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import option
from align.declared import BATCH
from align.train.backprop_sampling import renoised_last_steps, run_chain
from align.train.objectives.backprop_common import CURVES, chain_length, check_backprop_run
from align.train.objectives.base import Algorithm, BackpropObjective, Method


@dataclass
class DraftLVOptions:
    draft_lv_copies: int = option(2, "DRaFT-LV's n: re-noised copies of each image whose last step carries the "
                                  "gradient (the paper: 2)", "--algorithm draft-lv", within=BATCH)

    def check(self) -> None:
        check_backprop_run(self, "draft-lv")


class DRaFTLV(BackpropObjective):
    def __init__(self, copies: int):
        self.copies = copies

    @classmethod
    def from_config(cls, sampler, config) -> DRaFTLV:
        chain_length(sampler, "draft-lv")  # one line when the sampler cannot sample with gradients
        return cls(config.draft_lv_copies)

    @staticmethod
    def kept_forwards(config) -> int:
        return config.draft_lv_copies  # the last step, once per re-noised copy (one batched call)

    def sample(self, sampler, predict, noise, generator):
        steps = len(sampler.chain_timesteps())
        final = run_chain(sampler, predict, noise, generator, first_trained=steps)  # no gradient
        return renoised_last_steps(sampler, predict, final, generator, self.copies), {}

    def reward_loss(self, rewards):
        return -rewards.mean()

    def describe(self) -> str:
        return f"DRaFT-LV: the last step taken again from {self.copies} re-noised copies of each image, with gradients"


ALGORITHM = Algorithm(
    name="draft-lv",
    summary="DRaFT-LV: reward backpropagation through the last step, from re-noised copies of each image",
    method=Method("DRaFT-LV", "Clark et al. 2024"),
    objective=DRaFTLV,
    options=DraftLVOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ode", "drop_zero_advantage": False},
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=CURVES,
)
