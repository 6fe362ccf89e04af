"""The paired change of a held-out evaluation (the same prompts and seeds scored before and after training),
overall and, for captions of the shapes testbed, by the part of the caption split they come from."""

from __future__ import annotations

from align.metrics import PairedChange, paired_change
from align.testbed.split import part_of_prompt

# what a part means to a run that trained on testbed-train (align/testbed/split.py)
PART_LABELS: dict[str | None, str] = {"heldout": "unseen captions", "novel": "unseen combinations",
                                      "train": "training-part captions", None: "held-out prompts"}


def changes_by_part(before, after, prompts: list[str]) -> dict[str, PairedChange]:
    """{label: paired change} for each part present among ``prompts`` (PART_LABELS' order)."""
    parts = [part_of_prompt(p) for p in prompts]
    changes = {}
    for part, label in PART_LABELS.items():
        rows = [i for i, q in enumerate(parts) if q == part]
        if rows:
            changes[label] = paired_change([before[i] for i in rows], [after[i] for i in rows], [prompts[i] for i in rows])
    return changes


def describe_change(change: PairedChange, unit: str = "caption") -> str:
    """'+0.0870 ± 0.0100 per image, ± 0.0140 by caption (800 images, 151 captions: 6.2 SE by caption)'."""
    return (f"{change.mean:+.4f} ± {change.sem_images:.4f} per image, ± {change.sem_prompts:.4f} by {unit} "
            f"({change.images} images, {change.prompts} {unit}s: {change.prompt_se_ratio:.1f} SE by {unit})")
