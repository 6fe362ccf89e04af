"""The bundled prompt sets of the flow-RL papers: by name, with their sources and licences beside them."""

from __future__ import annotations

import pytest

from align.data.prompt_sets import PROMPTS_DIR, known_sets, load_prompt_set
from rewards.geneval import bundled_metadata
from rewards.ocr_rule import quoted_text


def test_geneval_set_carries_its_tasks_as_categories():
    prompts = load_prompt_set("geneval")
    table = bundled_metadata()
    assert len(prompts) == 553 and prompts.prompts[0] == "a photo of a bench"
    assert prompts.categories == [table[p]["tag"] for p in prompts.prompts]
    assert len(load_prompt_set("geneval", num_prompts=5)) == 5


@pytest.mark.parametrize("name, count", [("flow-grpo-ocr", 1018), ("flow-grpo-pickscore", 25432),
                                         ("flow-grpo-pickscore-test", 2048)])
def test_flow_grpo_sets_load_whole(name, count):
    prompts = load_prompt_set(name)
    assert prompts.name == name and len(prompts) == count and len(set(prompts.prompts)) == count
    assert name in known_sets()


def test_every_ocr_prompt_has_text_to_render():
    assert all(quoted_text(p).strip() for p in load_prompt_set("flow-grpo-ocr").prompts)


def test_sources_and_licences_are_recorded_beside_the_files():
    sources = (PROMPTS_DIR / "SOURCES.md").read_text()
    for name in ("flow_grpo_ocr_test.txt", "flow_grpo_pickscore_train.txt", "flow_grpo_pickscore_test.txt",
                 "evaluation_metadata.jsonl"):
        assert name in sources
    assert "MIT" in (PROMPTS_DIR / "LICENSE.flow_grpo").read_text()
