"""Does a held-out prompt set share prompts with a run's training prompts? Checked before any work starts.

Captions of the shapes testbed are compared by scene (``align.testbed.split.scene_key``: "a red circle and a
blue square" is "a blue square and a red circle"), any other prompt by its text with case and spacing ignored.

- Two testbed sets (``testbed-train``, ``testbed-heldout``, ``testbed-novel``, the unsplit ``testbed``) that
  overlap are refused in one line: the caption split offers disjoint ones by name, so an overlap means a wrong name.
- Any other source (a user's prompt file, a paper's sets, a hub dataset) gets one line with the overlap count and
  the run goes on: such sets are the user's to choose (Flow-GRPO's own Pick-a-Pic train and test prompts share 6 of
  the 2,048 test prompts up to case and spacing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from align.cli import ConfigError
from align.data.prompt_sets import TESTBED_SETS, load_prompt_list
from align.testbed.split import scene_key
from rewards.shapes_grammar import CaptionError


@dataclass(frozen=True)
class Overlap:
    """Held-out prompts (``shared`` of ``total``, repeats counted; ``distinct`` different ones) also trained on."""

    shared: int
    distinct: int
    total: int


def prompt_key(prompt: str) -> str:
    """What makes two prompts the same prompt: the scene of a testbed caption, else the text."""
    try:
        return "scene:" + scene_key(prompt)
    except CaptionError:
        return "text:" + " ".join(prompt.lower().split())


def prompt_overlap(train_prompts: list[str], heldout_prompts: list[str]) -> Overlap:
    trained = {prompt_key(p) for p in train_prompts}
    shared = [key for key in map(prompt_key, heldout_prompts) if key in trained]
    return Overlap(len(shared), len(set(shared)), len(heldout_prompts))


def is_testbed_set(spec: str) -> bool:
    return spec.partition(":")[0].partition("[")[0].strip() in TESTBED_SETS


def report_overlap(train_spec: str, train_prompts: list[str], heldout_spec: str, heldout_prompts: list[str],
                   train_flag: str = "--prompts", heldout_flag: str = "--eval_prompts",
                   log: Callable[[str], None] = print) -> Overlap:
    """Refuse overlapping testbed sets (ConfigError); for other sources log the overlap count. The overlap found."""
    found = prompt_overlap(train_prompts, heldout_prompts)
    if not found.shared:
        return found
    what = (f"{heldout_flag} {heldout_spec!r} shares {found.shared} of its {found.total} prompts ({found.distinct} "
            f"distinct) with the training prompts {train_flag} {train_spec!r}")
    if is_testbed_set(train_spec) and is_testbed_set(heldout_spec):
        raise ConfigError(f"{what}: held out must mean unseen; train on testbed-train:<n>[:<seed>] and hold out "
                          "testbed-heldout:<n>[:<seed>] or testbed-novel:<n>[:<seed>] (disjoint by construction)")
    log(f"[data] {what}: the held-out score mixes prompts seen in training with unseen ones")
    return found


def check_heldout_disjoint(train_spec: str | None, heldout_spec: str | None, train_flag: str = "--prompts",
                           heldout_flag: str = "--eval_prompts") -> Overlap | None:
    """The trainers' check: a run's held-out set against its training prompts (both given as specs)."""
    if not train_spec or not heldout_spec:
        return None
    return report_overlap(train_spec, load_prompt_list(train_spec), heldout_spec, load_prompt_list(heldout_spec),
                         train_flag, heldout_flag, log=lambda line: print(line, flush=True))
