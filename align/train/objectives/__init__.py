"""The online-RL trainer's algorithms, one line per objective file: the table that --algorithm, its --help, the config
checks, the trainer, the memory planner and the model card read. A new algorithm is a file of this package with its
``Objective``, its options and its ``ALGORITHM`` entry (align/train/objectives/base.py), and one line here."""

from __future__ import annotations

from align.cli import ConfigError
from align.train.objectives import alignprop, awm, dgpo, draft, draft_lv, grpo_guard, nft, ppo, refl
from align.train.objectives.base import Algorithm

ALGORITHMS: tuple[Algorithm, ...] = (
    ppo.ALGORITHM,
    nft.ALGORITHM,
    awm.ALGORITHM,
    grpo_guard.ALGORITHM,
    dgpo.ALGORITHM,
    draft.ALGORITHM,
    draft_lv.ALGORITHM,
    alignprop.ALGORITHM,
    refl.ALGORITHM,
)

# The algorithms' own option dataclasses, which the online-RL trainer's config inherits.
OPTIONS: tuple[type, ...] = tuple(entry.options for entry in ALGORITHMS if entry.options is not None)


def algorithm_names() -> list[str]:
    return [entry.name for entry in ALGORITHMS]


def algorithm(name: str) -> Algorithm:
    """The entry of --algorithm ``name`` (one line naming the valid ones otherwise)."""
    for entry in ALGORITHMS:
        if entry.name == name:
            return entry
    raise ConfigError(f"--algorithm must be one of {', '.join(algorithm_names())}, got {name!r}")


def algorithm_help() -> str:
    return "; ".join(f"{entry.name}: {entry.summary}" for entry in ALGORITHMS)
