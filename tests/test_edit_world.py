"""The shapes editing world (rewards/shapes_edit.py), its edit prompts (rewards/edit_prompts.py), its exact oracle
(shapes-edit-oracle) and its prompt sets (testbed-edit:<n>[:<seed>])."""

from __future__ import annotations

import random

import pytest

import rewards
from align.data.prompt_sets import PromptSetError, load_prompt_set
from align.testbed.edit_world import sample_edit_prompts, target_scene_image, wrong_instruction
from rewards.edit_prompts import (
    edit_prompt,
    is_edit_prompt,
    load_source,
    parse_edit_prompt,
    without_instruction,
)
from rewards.shapes_edit import (
    EditError,
    Instruction,
    SceneObject,
    apply_instruction,
    format_instruction,
    format_scene,
    parse_instruction,
    parse_scene,
    render_scene,
    sample_edit,
)

SCENE = (SceneObject("circle", "red", 0, 1), SceneObject("square", "blue", 2, 2), SceneObject("circle", "green", 1, 0))


def test_scene_specs_and_instructions_round_trip_and_refer_by_shape_when_unique():
    spec = format_scene(SCENE)
    assert spec == "shapes:red circle 0,1;blue square 2,2;green circle 1,0" and parse_scene(spec) == SCENE
    recolour = parse_instruction("make the red circle blue", SCENE)
    assert recolour == Instruction("recolour", SCENE[0], colour="blue")
    move = parse_instruction("move the square to the left", SCENE)
    assert move.target == SCENE[1] and format_instruction(move, SCENE) == "move the square to the left"
    assert apply_instruction(SCENE, move)[1] == SceneObject("square", "blue", 1, 2)
    assert apply_instruction(SCENE, parse_instruction("remove the green circle", SCENE)) == SCENE[:2]
    with pytest.raises(EditError, match="names 2 objects"):
        parse_instruction("remove the circle", SCENE)  # two circles: the colour is needed
    with pytest.raises(EditError, match="leaves the grid"):
        apply_instruction(SCENE, parse_instruction("move the square down", SCENE))


def test_edit_prompts_carry_their_source_and_the_dropped_instruction_keeps_it(tmp_path):
    prompt = edit_prompt(format_scene(SCENE), "make the red circle blue")
    assert is_edit_prompt(prompt) and not is_edit_prompt("a red circle")
    assert parse_edit_prompt(prompt).instruction == "make the red circle blue"
    assert without_instruction(prompt) == f"[source: {format_scene(SCENE)}]" and without_instruction("a cat") == ""
    assert load_source(format_scene(SCENE), 32).size == (32, 32)
    path = tmp_path / "cat.png"
    render_scene(SCENE, 48).save(path)
    assert load_source(str(path), 32).size == (32, 32)
    with pytest.raises(ValueError, match="not an image file"):
        load_source(str(tmp_path / "missing.png"))


def test_the_oracle_is_exact_on_renders_and_penalises_doing_nothing_or_the_wrong_thing():
    oracle = rewards.load("shapes-edit-oracle")
    prompts = sample_edit_prompts(200, seed=7)
    assert oracle.score(prompts, [target_scene_image(p) for p in prompts]).min() == 1.0
    sources = [load_source(parse_edit_prompt(p).source) for p in prompts]
    assert oracle.score(prompts, sources).max() <= 0.5  # the instruction was not done
    rng = random.Random(0)
    wrong = [wrong_instruction(p, rng) for p in prompts[:50]]
    scores = oracle.score(prompts[:50], [target_scene_image(w) for w in wrong])
    assert scores.max() < 1.0 and scores.mean() < 0.75  # another edit done: the asked one not, something else changed


def test_every_kind_of_edit_is_drawn_and_every_drawn_edit_can_be_done():
    rng = random.Random(3)
    kinds = set()
    for _ in range(300):
        scene, instruction = sample_edit(rng)
        kinds.add(instruction.kind)
        apply_instruction(scene, parse_instruction(format_instruction(instruction, scene), scene))
    assert kinds == {"recolour", "move", "remove"}


def test_testbed_edit_prompt_sets_are_seeded_and_refuse_bad_specs():
    first = load_prompt_set("testbed-edit:16:3")
    assert first.prompts == load_prompt_set("testbed-edit:16:3").prompts != load_prompt_set("testbed-edit:16:4").prompts
    assert len(first) == 16 and set(first.categories) <= {"recolour", "move", "remove"}
    for bad in ("testbed-edit:x", "testbed-edit:0:1", "testbed-edit:5:1:2"):
        with pytest.raises(PromptSetError, match="testbed-edit:<count>"):
            load_prompt_set(bad)


def test_the_oracle_refuses_prompts_it_cannot_judge_in_one_line():
    oracle = rewards.load("shapes-edit-oracle")
    with pytest.raises(ValueError, match="edit prompts"):
        oracle.check_prompts_supported(["a red circle"])
    with pytest.raises(ValueError, match="names 0 objects"):
        oracle.check_prompts_supported([edit_prompt(format_scene(SCENE), "remove the triangle")])
