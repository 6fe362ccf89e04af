"""AlignProp (Prabhudesai, Goyal, Pathak and Fragkiadaki 2023, "Aligning Text-to-Image Diffusion Models with Reward
Backpropagation"): sample with the trained model and backpropagate the reward through a randomly truncated end of the
chain, every step's denoiser call checkpointed (its activations recomputed in the backward).

Source: mihirp1998/AlignProp @ b22918a (sd_pipeline.py ``pipeline_step_with_grad``, alignprop_trainer.py,
config/alignprop_config.py, hps.sh / aesthetic.sh); pinned against the authors' lines by
experiments/reward_backprop_reference.py -> tests/data/reward_backprop_reference.json.

- Truncation, once per sampling batch ("gaussian"): t = int(N(42, 5)) drawn again until 1 <= t < 50 of the 50
  steps; the predictions of steps before t are detached, so the gradient flows through the last 50 - t steps (about 8).
  Here the mean and std are fractions of the chain (0.84 and 0.1), so other step counts keep the same share; their
  "fixed" K = 1 scripts (*_k1.sh: t = 49) are --alignprop_truncation_mean 0.98 --alignprop_truncation_std 0.
- Sampling: DDIM, η = 1 (``--sampler ddim``), 50 steps, guidance 5, the prediction of both guidance halves checkpointed.
- Loss: HPS 1 - score (here -reward, the same gradient), aesthetic |score - 10|; times loss_coeff 0.01, averaged over
  the batch. AdamW lr 1e-3, weight decay 1e-4, gradient norm 1, LoRA r4 (alpha 4) on to_q/to_k/to_v/to_out.0, fp16;
  batch 8 per GPU x 4 accumulation x 4 GPUs = 128 images per optimiser step, one step per epoch, 25 epochs (HPS).

Where we differ: the repository's loss functions map the images, already in [0, 1] (the pipeline's postprocess), once
more through x/2 + 1/2 (a leftover of the paper-era code, 7f4503f, whose images came straight from the VAE in
[-1, 1]): their judge sees images squeezed into [0.5, 1]; ours sees the image. The paper-era code drew the truncation
point afresh at every step (``random.randint(0, 50)`` inside the loop: steps with gradient need not be the last ones),
sampled with DDIM η = 0 at guidance 7.5 and clipped gradients at 5 with weight decay 0.1; its LoRA was diffusers'
LoRAAttnProcessor (rank 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import ConfigError, option
from align.declared import POSITIVE
from align.train.backprop_sampling import draw_first_trained_step, truncated_sample
from align.train.objectives.backprop_common import CURVES, chain_length, check_backprop_run
from align.train.objectives.base import Algorithm, BackpropObjective, Method
from align.train.report import Curve


@dataclass
class AlignPropOptions:
    alignprop_truncation_mean: float = option(
        0.84, "AlignProp's randomised truncation: the first step whose prediction keeps its gradient is drawn as "
        "int(N(mean, std)) in steps, mean and std given as fractions of the chain (the authors: 42 and 5 of 50 steps)",
        "--algorithm alignprop", within="(0, 1)")
    alignprop_truncation_std: float = option(0.1, "the std of AlignProp's truncation point, a fraction of the chain "
                                             "(the authors: 5 of 50; 0: a fixed truncation)", "--algorithm alignprop",
                                             within="[0, 1]")
    alignprop_loss_scale: float = option(0.01, "AlignProp's loss_coeff: the loss is this x -reward (the authors: 0.01)",
                                         "--algorithm alignprop", within=POSITIVE)
    alignprop_checkpointing: bool = option(True, "recompute each backpropagated step's denoiser call in the backward "
                                           "(the authors' checkpointed steps: memory of latents, not activations)",
                                           "--algorithm alignprop")

    def check(self) -> None:
        check_backprop_run(self, "alignprop")


class AlignProp(BackpropObjective):
    def __init__(self, mean: float, std: float, loss_scale: float, checkpointed: bool):
        self.mean, self.std, self.loss_scale, self.checkpointed = mean, std, loss_scale, checkpointed

    @classmethod
    def from_config(cls, sampler, config) -> AlignProp:
        steps = chain_length(sampler, "alignprop")
        if not 1 <= config.alignprop_truncation_mean * steps < steps:
            raise ConfigError(f"--alignprop_truncation_mean {config.alignprop_truncation_mean} of {steps} steps is no "
                              f"step of the chain (1 to {steps - 1})")
        return cls(config.alignprop_truncation_mean, config.alignprop_truncation_std, config.alignprop_loss_scale,
                   config.alignprop_checkpointing)

    @staticmethod
    def kept_forwards(config) -> int:
        # checkpointed: one step's activations at a time (recomputed in the backward); else the expected truncation
        if config.alignprop_checkpointing:
            return 1
        return max(1, round(config.num_inference_steps * (1 - config.alignprop_truncation_mean)))

    def sample(self, sampler, predict, noise, generator):
        steps = len(sampler.chain_timesteps())
        first = draw_first_trained_step(steps, self.mean * steps, self.std * steps, generator)
        latents = truncated_sample(sampler, predict, noise, generator, steps - first, checkpointed=self.checkpointed)
        return latents, {"backprop_steps": float(steps - first)}

    def reward_loss(self, rewards):
        return self.loss_scale * -rewards.mean()

    def describe(self) -> str:
        return (f"randomised truncation: gradients from step int(N({self.mean:g}, {self.std:g}) x steps) on, loss "
                f"{self.loss_scale:g} x -reward, checkpointed steps: {self.checkpointed}")


ALGORITHM = Algorithm(
    name="alignprop",
    summary="AlignProp: reward backpropagation through a randomly truncated, checkpointed end of the chain",
    method=Method("AlignProp", "Prabhudesai et al. 2023"),
    objective=AlignProp,
    options=AlignPropOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ddim", "drop_zero_advantage": False},  # the authors' DDIM with eta 1
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=(*CURVES, Curve("steps backpropagated (the truncation drawn)", ("backprop_steps",))),
)
