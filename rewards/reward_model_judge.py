"""A judge around a reward model: ``rewards(prompts, pil_images) -> tensor[N]`` scored and compared with the
model's temperature. Shared by the folders ``align.train.reward_model`` writes (``rewards.trained``) and LLaVA-Reward
(``rewards.llava_reward``), in a module of its own so neither of those imports the other's judge.
"""

from __future__ import annotations

import torch

from rewards.base import Judge, Preference, check_pair_counts
from rewards.images import Images, num_images, to_pil
from rewards.weights import batched, check_batch_size, check_prompts


class TrainedRewardError(ValueError):
    """A trained reward-model folder that cannot be loaded (missing files, unknown kind)."""


class TrainedRewardJudge(Judge):
    """A judge over any model with ``rewards(prompts, pil_images) -> tensor[N]``.

    score() = r / (tau * T) with the stored calibration temperature T (calibrated=True), or the
    raw reward r (calibrated=False). compare() gives P(a > b) = sigmoid((r_a - r_b) / (tau * T)).
    """

    def __init__(self, model, name: str, tau: float = 1.0, temperature: float = 1.0, calibrated: bool = True,
                 batch_size: int = 32, tie_margin: float = 0.0):
        super().__init__(name=name, tie_margin=tie_margin)
        if tau <= 0 or temperature <= 0:
            raise TrainedRewardError(f"judge {name!r}: tau and temperature must be > 0, got {tau} and {temperature}")
        self.model = model.eval()
        self.tau, self.temperature, self.calibrated = float(tau), float(temperature), calibrated
        self.batch_size = check_batch_size(batch_size)

    @property
    def scale(self) -> float:
        """Divide raw rewards by this to get preference logits."""
        return self.tau * self.temperature

    @torch.no_grad()
    def raw_rewards(self, prompts: list[str], images: Images) -> torch.Tensor:
        prompts = check_prompts(prompts, num_images(images), self.name)
        pil = to_pil(images)
        out = [
            self.model.rewards(prompts[i : i + len(chunk)], chunk).float().cpu()
            for i, chunk in zip(range(0, len(pil), self.batch_size), batched(pil, self.batch_size))
        ]
        return torch.cat(out) if out else torch.empty(0)

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        rewards = self.raw_rewards(prompts, images)
        return rewards / self.scale if self.calibrated else rewards

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        check_pair_counts(prompts, images_a, images_b)
        reward_a, reward_b = self.raw_rewards(prompts, images_a), self.raw_rewards(prompts, images_b)
        out = []
        for ra, rb in zip(reward_a.tolist(), reward_b.tolist()):
            logit = (ra - rb) / self.scale
            raw = {"reward_a": ra, "reward_b": rb, "logit": logit}
            if abs(logit if self.calibrated else ra - rb) <= self.tie_margin:
                out.append(Preference(0.5, tie=True, raw=raw))
            else:
                out.append(Preference(float(torch.sigmoid(torch.tensor(logit))), raw=raw))
        return out

    def __repr__(self) -> str:
        return (f"TrainedRewardJudge(name={self.name!r}, tau={self.tau}, temperature={self.temperature:.4g}, "
                f"calibrated={self.calibrated})")
