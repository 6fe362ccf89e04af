"""The testbed's caption split (align/testbed/split.py): held-out sets share no caption with training sets, by
construction, in every bundled config and script; the overlap check refuses or reports (align/data/prompt_overlap.py)."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest
import yaml

from align.cli import ConfigError
from align.data.prompt_overlap import check_heldout_disjoint, prompt_overlap, report_overlap
from align.data.prompt_sets import PromptSetError, load_prompt_list, load_prompt_set
from align.testbed.edit_world import EVAL_SEED
from align.testbed.scene import sample_captions
from align.testbed.split import (
    NOVEL_PAIRS,
    PARTS,
    names_novel_pair,
    part_of_prompt,
    sample_split_captions,
    scene_key,
    split_of,
)
from rewards.shapes_grammar import CATEGORIES, parse_caption
from tests.script_loader import load_experiment

ROOT = Path(__file__).resolve().parents[1]


def test_a_scene_is_one_caption_whatever_the_order_it_is_named_in():
    assert scene_key("a red circle and a blue square") == scene_key("a blue square and a red circle")
    assert scene_key("a circle, a square and a triangle") == scene_key("a triangle, a circle and a square")
    assert scene_key("two red circles right of a blue square") == scene_key("a blue square left of two red circles")
    assert scene_key("a circle below a square") == scene_key("a square above a circle")
    assert scene_key("a circle left of a square") != scene_key("a circle right of a square")
    assert scene_key("a circle left of a square") != scene_key("a circle above a square")
    for caption in sample_captions(300, seed=9):  # the key is itself a caption of the same scene
        assert scene_key(scene_key(caption)) == scene_key(caption)
        assert split_of(scene_key(caption)) == split_of(caption)


def test_every_caption_lies_in_one_part_and_the_parts_are_what_they_claim():
    captions = sample_captions(3000, seed=1)
    parts = [split_of(c) for c in captions]
    assert set(parts) == set(PARTS)
    for caption, part in zip(captions, parts):
        assert (part == "novel") == names_novel_pair(caption)
    # every shape and every colour still occurs in training; the held-out pairs never do
    train = [parse_caption(c) for c, p in zip(captions, parts) if p == "train"]
    pairs = {(g.colour, g.shape) for c in train for g in c.groups if g.colour}
    assert not pairs & NOVEL_PAIRS and len(pairs) == 18 - len(NOVEL_PAIRS)
    assert part_of_prompt("a photo of a cat") is None


def test_version_1_of_the_split_never_changes():
    """The split is frozen (old and new runs must name the same captions): its assignment of a fixed sample of the
    grammar is pinned. A different split is a new version with set names of its own, not an edit of this one."""
    captions = sorted(set(sample_captions(4000, seed=0)))
    assignment = "\n".join(f"{c}\t{split_of(c)}" for c in captions)
    assert hashlib.sha256(assignment.encode()).hexdigest()[:16] == "35050bd19f5ba96a"


@pytest.mark.parametrize("part", PARTS)
def test_a_part_set_draws_only_its_part_with_every_category_it_has(part):
    captions = sample_split_captions(400, 3, part)
    assert captions == sample_split_captions(400, 3, part) and captions != sample_split_captions(400, 4, part)
    assert {split_of(c) for c in captions} == {part}
    categories = {parse_caption(c).category for c in captions}
    assert categories == (set(CATEGORIES) - {"object"} if part == "novel" else set(CATEGORIES))


def test_held_out_sets_are_distinct_scenes_in_equal_shares_until_a_category_runs_out():
    held_out = load_prompt_list("testbed-heldout:600:3")
    assert len({scene_key(c) for c in held_out}) == 600  # no scene twice: each caption is one more unseen caption
    shares = Counter(parse_caption(c).category for c in held_out)
    assert shares["object"] == 2  # the object category has 2 held-out scenes; the others share the rest evenly
    assert min(shares[c] for c in ("attribute", "count", "spatial")) > 150
    assert len(set(load_prompt_list("testbed-train:600:3"))) < 600  # training sets keep the sampler's repeats
    with pytest.raises(PromptSetError, match=r"\[1, 4,000\]"):
        load_prompt_set("testbed-heldout:4001")


def test_held_out_and_novel_sets_share_no_scene_with_any_training_set():
    train = load_prompt_list("testbed-train:4000")
    for spec in ("testbed-heldout:1000:1", "testbed-novel:1000:2"):
        assert prompt_overlap(train, load_prompt_list(spec)).shared == 0
    assert prompt_overlap(load_prompt_list("testbed-heldout:1000:1"), load_prompt_list("testbed-novel:1000:2")).shared == 0
    # the unsplit grammar the old configs trained on overlaps all of them
    assert prompt_overlap(load_prompt_list("testbed:256"), load_prompt_list("testbed-heldout:1000:4242")).shared > 0


def _bundled_sets() -> tuple[set[str], set[tuple[str, int | None, int]]]:
    """Every testbed training spec and every held-out set (spec, count, seed) that configs/ and the experiments name."""
    train, held_out = set(), set()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        evaluation = "models" in config  # align.evaluate's config: its prompts are held out
        for key in ("prompts", "train_prompts"):
            if str(config.get(key, "")).startswith("testbed") and not (evaluation and key == "prompts"):
                train.add(config[key])
        for key, count, seed in (("eval_prompts", "eval_num_prompts", "eval_prompt_seed"), ("prompts", "num_prompts", "prompt_seed")):
            spec = str(config.get(key, ""))
            if spec.startswith("testbed") and (key == "eval_prompts" or evaluation):
                held_out.add((spec, config.get(count), config.get(seed, 0)))
    paired = load_experiment("paired_heldout")
    for text in paired.DEFAULT_SETS:
        name, spec, _ = paired.parse_set(text)
        (train if name == "seen" else held_out).add(spec if name == "seen" else (spec, None, 0))
    return train, held_out


def test_no_bundled_held_out_set_shares_a_caption_with_any_bundled_training_set():
    train, held_out = _bundled_sets()
    assert {"testbed-train:256", "testbed-train:512:1"} <= train and len(held_out) >= 5
    trained = [p for spec in sorted(train) for p in load_prompt_list(spec)]
    for spec, count, seed in sorted(held_out, key=str):
        edits = spec.startswith("testbed-edit:") and spec.endswith(f":{EVAL_SEED}")  # the editing world's held-out edits
        assert spec.startswith(("testbed-heldout", "testbed-novel")) or edits, spec
        prompts = load_prompt_set(spec, count, seed=seed).prompts
        assert prompt_overlap(trained, prompts).shared == 0, spec


def test_overlapping_testbed_sets_are_refused_in_one_line_and_other_sources_reported(tmp_path, capsys):
    with pytest.raises(ConfigError) as refused:
        check_heldout_disjoint("testbed:256", "testbed:200:1000")  # the old configs' pair: 82 shared captions
    message = str(refused.value)
    assert "\n" not in message and "--eval_prompts 'testbed:200:1000' shares" in message and "testbed-heldout" in message
    assert check_heldout_disjoint("testbed-train:256", "testbed-heldout:200:1000").shared == 0
    assert check_heldout_disjoint(None, "testbed:200:1000") is None
    # a user's file: the count is reported and the run goes on; a reordered caption is the same caption
    mine = tmp_path / "mine.txt"
    mine.write_text("a blue square and a red circle\na photo of a cat\nA Photo of  a cat\na green circle\n")
    found = report_overlap("testbed-train:1", ["a red circle and a blue square", "a photo of a cat"],
                           str(mine), load_prompt_list(str(mine)), log=print)
    assert (found.shared, found.distinct, found.total) == (3, 2, 4)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "shares 3 of its 4 prompts (2 distinct)" in out


def test_testbed_set_names_and_their_errors():
    assert load_prompt_set("testbed-novel:5:3").name == "testbed-novel"
    assert load_prompt_set("testbed-heldout", 7, seed=2).prompts == load_prompt_list("testbed-heldout:7:2")
    assert load_prompt_list("testbed:5:1") == sample_captions(5, seed=1)  # the old name keeps its captions
    for bad in ("testbed-heldout:x", "testbed-train:5:1:2", "testbed-novel:0"):
        with pytest.raises((PromptSetError, ConfigError), match="testbed-"):
            load_prompt_set(bad)


def test_paired_heldout_groups_edits_by_their_kind_and_captions_by_their_category():
    category_of = load_experiment("paired_heldout").caption_category
    edits = load_prompt_list(f"testbed-edit:60:{EVAL_SEED}")
    assert {category_of(edit) for edit in edits} == {"recolour", "move", "remove"}
    assert category_of("[source: shapes:red circle 0,1] make the red circle blue") == "recolour"
    captions = load_prompt_list("testbed-heldout:40:1")
    assert [category_of(c) for c in captions] == [parse_caption(c).category for c in captions]
    assert set(map(category_of, captions)) <= set(CATEGORIES)
