"""DDPO rewards from any judge in ``rewards``.

- A pointwise judge (``score``) gives each image its score.
- A weighted mix, ``pickscore:0.7,aesthetic:0.3``, gives Σ weight·score (raw scores, not rescaled); with
  ``--advantage gdpo`` each judge's scores are normalised within each prompt's group first (GDPO).
- A pairwise-only judge (VLM or API model that only answers "which of two is better") gives each
  image its win rate against the other images drawn for the same prompt: every pair in the group
  is compared once (the judge itself controls position bias by asking both orders), a tie counts
  ½, and abstained pairs are left out.

Any failure of a judge, or a reward that is NaN/inf, raises ``RewardError`` naming the judge, so
the trainer can stop cleanly before the bad rewards touch the weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

import rewards
from align.cli import ConfigError
from align.run_folder import RunStopped
from align.train.advantages import gdpo_combined_rewards
from rewards.base import Judge


class RewardError(RunStopped):
    """A judge failed or returned a non-finite reward."""


def group_indices(prompts: list[str]) -> list[list[int]]:
    """Indices of the samples that share a prompt, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return list(groups.values())


def win_rates(judge: Judge, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """Each image's mean probability of beating the other images of its prompt (NaN if never judged)."""
    groups = group_indices(prompts)
    if any(len(g) < 2 for g in groups):
        raise RewardError(
            f"judge {judge.name!r} is pairwise-only: every prompt needs at least 2 images in a batch "
            "to compute win rates (raise images_per_prompt)"
        )
    pairs = [pair for group in groups for pair in itertools.combinations(group, 2)]
    firsts = [a for a, _ in pairs]
    seconds = [b for _, b in pairs]
    verdicts = judge.compare([prompts[a] for a in firsts], images[firsts], images[seconds])
    if len(verdicts) != len(pairs):
        raise RewardError(f"judge {judge.name!r} returned {len(verdicts)} verdicts for {len(pairs)} pairs")
    wins = torch.zeros(len(prompts), dtype=torch.float64)
    counts = torch.zeros(len(prompts), dtype=torch.float64)
    for (a, b), verdict in zip(pairs, verdicts):
        if verdict.abstained:
            continue
        p = 0.5 if verdict.tie else float(verdict.prob_a)
        wins[a] += p
        wins[b] += 1.0 - p
        counts[a] += 1
        counts[b] += 1
    return (wins / counts).float()  # 0/0 = NaN for an image whose pairs all abstained


@dataclass
class RewardMember:
    weight: float
    name: str
    judge: Judge
    pairwise: bool


class MixedReward:
    """Σ weight·reward over the judges of a spec such as ``pickscore:0.7,aesthetic:0.3``.

    ``normalise_each`` (GDPO, ``--advantage gdpo``): each judge's rewards are first normalised within each prompt's
    group of images (align/train/advantages.py ``gdpo_combined_rewards``), so the mix's value is relative to the
    group, as a pairwise judge's win rate is: it needs groups, and a held-out score needs a pointwise --eval_judge."""

    def __init__(self, spec: str, loader: Callable[..., Judge] = rewards.load, normalise_each: bool = False):
        self.spec, self.normalise_each = spec, normalise_each
        parsed = rewards.parse_judges(spec)  # parsed once; each judge loads from its parsed spec
        if normalise_each and len(parsed) < 2:
            raise ConfigError(f"--advantage gdpo normalises each judge of a mix of several (such as "
                              f"'shapes-oracle:1,shapes-clip:1'); --reward {spec!r} has one: use --advantage group")
        self.members = []
        for member in parsed:
            judge = loader(member)
            self.members.append(RewardMember(member.weight, member.name, judge, not judge.pointwise))

    @property
    def needs_groups(self) -> bool:
        return self.normalise_each or any(m.pairwise for m in self.members)

    def __call__(self, prompts: list[str], images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards [N] (float32, CPU) and each member's raw rewards; raises RewardError on failure."""
        total = torch.zeros(len(prompts))
        parts, scored = {}, []
        for member in self.members:
            try:
                if member.pairwise:
                    values = win_rates(member.judge, prompts, images)
                else:
                    values = member.judge.score(prompts, images)
                values = torch.as_tensor(values).detach().float().cpu().reshape(-1)
            except RewardError:
                raise
            except Exception as err:  # any judge failure (network, parsing, OOM) stops training cleanly
                raise RewardError(f"judge {member.name!r} failed: {type(err).__name__}: {err}") from err
            if values.shape[0] != len(prompts):
                raise RewardError(f"judge {member.name!r} returned {values.shape[0]} rewards for {len(prompts)} images")
            bad = int((~torch.isfinite(values)).sum())
            if bad:
                raise RewardError(
                    f"judge {member.name!r} returned {bad} non-finite reward(s) (NaN/inf) out of {len(values)} (from an "
                    "API or VLM judge: answers it could not parse, refusals or failed calls; the raw answers are in the run "
                    "folder's judge_answers/)"
                )
            parts[member.name] = values
            total += member.weight * values
            scored.append(values)
        if self.normalise_each:
            combined = gdpo_combined_rewards(prompts, torch.stack(scored, dim=1), [m.weight for m in self.members])
            total = torch.as_tensor(combined, dtype=torch.float32)
        return total, parts

    def close(self) -> None:
        for member in self.members:
            member.judge.close()


class BackgroundRewards:
    """Score one batch in a worker thread while the next batch is being sampled.

    Judges that wait on I/O (API calls) or release the GIL (torch) overlap with sampling;
    ``result()`` re-raises the judge's RewardError in the training thread.
    """

    def __init__(self, reward: MixedReward):
        self.reward = reward
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def submit(self, prompts: list[str], images: torch.Tensor) -> Future:
        return self.pool.submit(self.reward, list(prompts), images.detach().cpu())

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
