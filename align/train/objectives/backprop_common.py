"""What the reward-backpropagation objectives share (DRaFT-K, DRaFT-LV, AlignProp, ReFL): the checks of a run that
samples with gradients, and the report's curves. Each objective is its own file beside this one."""

from __future__ import annotations

import rewards
from align.cli import ConfigError
from align.train.report import Curve

# The report's curves of every reward-backpropagation run (besides the epoch's mean reward, which the trainer plots).
CURVES = (Curve("loss (of the differentiable reward)", ("loss",)),
          Curve("gradient norm before clipping", ("grad_norm",)))


def check_backprop_run(config, name: str) -> None:
    """The settings a run that samples with gradients needs, checked before anything loads."""
    try:
        rewards.check_differentiable(config.reward)
    except (rewards.NotDifferentiableError, ValueError) as err:
        raise ConfigError(f"--algorithm {name} backpropagates the reward: {err}") from None
    if config.sample_batch_size != config.train_batch_size:
        raise ConfigError(f"--algorithm {name} trains each sampling batch as it is drawn: --sample_batch_size "
                          f"({config.sample_batch_size}) must equal --train_batch_size ({config.train_batch_size})")
    if config.kl_coef != 0:
        raise ConfigError(f"--algorithm {name} has no KL term (--kl_coef must be 0, got {config.kl_coef})")


def chain_length(sampler, name: str) -> int:
    """The steps of the sampler's chain, or one line when it cannot sample with gradients (a multistep solver, a
    window drawn per batch)."""
    try:
        return len(sampler.chain_timesteps())
    except ValueError as err:
        raise ConfigError(f"--algorithm {name} samples with gradients: {err}; use --sampler ode") from None


def check_chain_length(name: str, steps: int, total: int) -> None:
    if not 1 <= steps <= total:
        raise ConfigError(f"--algorithm {name} backpropagates through 1 to {total} steps (--num_inference_steps), "
                          f"got {steps}")
