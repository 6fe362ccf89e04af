"""UnifiedReward's questions and answer parsing (Wang et al. 2025), as the authors' code has them. Pure functions.

Source: github.com/CodeGoat24/UnifiedReward (commit ff6f520):

- questions: ``inference_qwen/image_generation/qwen_point_score_image_generation.py`` (pointwise, a score from
  1 to 5 after 'Final Score:') and ``qwen_pair_rank_image_generation.py`` (pairwise); the image(s) come first in
  the user message, then the text, with no labels between the images. They are the authors' protocol, so their
  text is kept word for word (a fact to match, like a loss formula), with ``{caption}`` where they put the prompt;
- pointwise parsing (``DiffusionDPO/sift_dpo_data.py``): the text after the last 'Final Score:' (the whole answer
  when it is absent), and its first run of digits (``\\d+``, so "3.5" reads 3); the authors count "no digits"
  as 0, we count it as an abstention. No range check, as theirs;
- pairwise parsing (``benchmark_evaluation/Qwen_evaluation/test_qwen_genAI_bench_image.py``): a verdict is the
  phrase "Image 1 is better", "Image 2 is better" or "Both images are equally good" appearing in the answer.
  The authors test each phrase on its own; an answer holding both image verdicts is an abstention here.
"""

from __future__ import annotations

import re

POINT_TEMPLATE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after 'Final "
    "Score:'.\nYour task is provided as follows:\nText Caption: [{caption}]"
)
PAIR_TEMPLATE = (
    "You are given a text caption and two generated images based on that caption. Your task is to evaluate and "
    "compare these images based on two key criteria:\n1. Alignment with the Caption: Assess how well each image "
    "aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, and "
    "attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of each image, "
    "including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nCompare both images "
    "using the above criteria and select the one that better aligns with the caption while exhibiting superior "
    "visual quality.\nProvide a clear conclusion such as \"Image 1 is better.\", \"Image 2 is better.\" and \"Both "
    "images are equally good.\"\nYour task is provided as follows:\nText Caption: [{caption}]"
)
FIRST, SECOND, TIE = "Image 1 is better", "Image 2 is better", "Both images are equally good"


def point_score(text: str) -> int | None:
    """The authors' pointwise score: first digits after the last 'Final Score:'; None when there are none."""
    digits = re.findall(r"\d+", text.split("Final Score:")[-1].strip())
    return int(digits[0]) if digits else None


def pair_verdict(text: str) -> int | None:
    """1 (first image shown), 2 (second), 0 (equally good); None when no verdict, or both images are named."""
    first, second = FIRST in text, SECOND in text
    if first and second:
        return None
    if first:
        return 1
    if second:
        return 2
    return 0 if TIE in text else None
