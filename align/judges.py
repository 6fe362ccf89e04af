"""Judges as the commands use them: loaded so that an unusable one fails before any work, comma lists of judge
specs, and pairwise comparisons shown in a random order."""

from __future__ import annotations

import numpy as np
import torch

import rewards
from align import metrics
from align.errors import ConfigError
from rewards.edit_prompts import is_edit_prompt
from rewards.spec import split_top_level


def split_list(text: str | None) -> list[str]:
    """Split a comma list, keeping commas inside [...] (judge options) together."""
    return split_top_level(text or "")


def check_judge_names(specs, flag: str, allow_mix: bool = False) -> None:
    """Every judge spec known to ``rewards`` (no judge is loaded); else one ConfigError naming the flag."""
    for spec in filter(None, specs):
        try:
            rewards.check_name(spec, allow_mix=allow_mix)
        except ValueError as err:
            raise ConfigError(f"{flag}: {err}") from None


def check_judges_take_prompts(judges, prompts: list[str], flag: str) -> None:
    """Every judge (or weighted mix: its members) can judge every prompt of ``prompts`` (a rule judge parses its
    captions): one line naming the prompt, before the run folder is written or an image made."""
    edits = [p for p in prompts if is_edit_prompt(p)]
    for judge in judges:
        for member in getattr(judge, "members", None) or [judge]:
            member_judge = getattr(member, "judge", member)
            if edits and not getattr(member_judge, "judges_edits", False):
                raise ConfigError(f"{flag}: judge {getattr(member_judge, 'name', 'judge')!r} cannot judge an edit (it sees "
                                  f"neither the source image nor the instruction: {edits[0][:60]!r}); judges of edits: "
                                  "the VLM and API judges, shapes-edit-oracle and the image-only rules")
            check = getattr(member_judge, "check_prompts_supported", None)
            if check is None:
                continue
            try:
                check(list(prompts))
            except ValueError as err:
                name = getattr(member_judge, "name", "judge")
                raise ConfigError(f"{flag}: judge {name!r} cannot judge these prompts: {err}") from None


def load_judge(spec: str | rewards.JudgeSpec, **options):
    """Load a judge and let it fail fast: a missing API key or weights, a model id the server rejects, a missing
    SDK or an option the judge does not take stop here with one message (ConfigError), before any generation."""
    try:
        judge = rewards.load(spec, **options)
        check_ready = getattr(judge, "check_ready", None)
        if callable(check_ready):
            check_ready()
    except (ValueError, RuntimeError, OSError, ImportError) as err:
        raise ConfigError(f"judge {str(spec)!r} is not usable: {err}") from None
    return judge


def compare_shuffled(judge, prompts: list[str], images_a: torch.Tensor, images_b: torch.Tensor, rng) -> np.ndarray:
    """Outcomes of A against B, each pair shown in a random order, so a position bias cancels out."""
    swap = torch.from_numpy(rng.random(len(prompts)) < 0.5)
    mask = swap.view(-1, 1, 1, 1)
    first = torch.where(mask, images_b, images_a)
    second = torch.where(mask, images_a, images_b)
    outcome = metrics.outcomes_from_preferences(judge.compare(prompts, first, second))
    return np.where(swap.numpy(), 1 - outcome, outcome)
