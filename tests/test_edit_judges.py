"""Judging edits: API judges (through the real SDKs, against the fake servers) asked the editing question with the
source image first, pointwise and pairwise with both orders; judges that cannot judge an edit refused in one line;
edit preference pairs read from the Pick-a-Pic-like and EditReward-Data schemas; the change outside the edit."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import ImageStat

import rewards
from align.cli import ConfigError
from align.data.pair_stream import open_pairs
from align.eval.edit_metrics import INSTRUCTION_CELLS, change_outside_edit
from align.judges import check_judges_take_prompts
from align.testbed.edit_world import sample_edit_prompts, target_scene_image
from align.testing.fake_judge_servers import FakeJudgeServer
from rewards.edit_prompts import edit_prompt, load_source, parse_edit_prompt
from rewards.images import encode_png
from rewards.judge_prompts import EDIT_CRITERIA

SECRET = "sk-TEST-edit-judges"
PROMPTS = sample_edit_prompts(2, seed=21)


def brightness(image) -> float:
    return sum(ImageStat.Stat(image.convert("L")).mean) / 255.0


def edit_judge(prompt: str, images: list) -> str:
    """A fake editing judge: the brighter edit is better; it checks that it was asked about an edit."""
    assert "IMAGE-1 is the source image" in prompt
    if "IMAGE-2 and IMAGE-3" in prompt:
        r1, r2 = (round(1 + 9 * brightness(im), 1) for im in images[1:3])
        return json.dumps({"analysis": "edits", "image_1_rating": r1, "image_2_rating": r2,
                           "better_image": 0 if r1 == r2 else (1 if r1 > r2 else 2)})
    return json.dumps({"analysis": "edit", "rating": round(1 + 9 * brightness(images[1]), 2)})


@pytest.fixture()
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with FakeJudgeServer("openai", answer=edit_judge, api_key=SECRET) as running:
        yield running


def edits(level: float) -> torch.Tensor:
    return torch.full((2, 3, 32, 32), level)


def test_pointwise_edit_question_shows_the_source_first(server):
    judge = rewards.load("openai:fake-model", base_url=server.base_url, mode="single", timeout=5)
    scores = judge.score(PROMPTS, torch.cat([edits(0.8)[:1], edits(0.2)[:1]]))
    assert scores[0] > scores[1]
    assert all(len(c["images"]) == 2 and EDIT_CRITERIA["alignment"] in c["prompt"] for c in server.calls)
    for prompt in PROMPTS:  # the calls arrive in any order: each prompt's question carries its instruction and source
        edit = parse_edit_prompt(prompt)
        (call,) = [c for c in server.calls if f'Instruction: "{edit.instruction}"' in c["prompt"]]
        assert np.array_equal(np.asarray(call["images"][0]), np.asarray(load_source(edit.source, 32)))


def test_pairwise_edit_question_asks_both_orders_with_the_source_first(server):
    judge = rewards.load("openai:fake-model", base_url=server.base_url, timeout=5)  # mode "pair"
    prefs = judge.compare(PROMPTS, edits(0.8), edits(0.2))
    assert [p.winner for p in prefs] == [0, 0] and all(p.raw["consistent"] for p in prefs)
    assert len(server.calls) == 4 and all(len(c["images"]) == 3 for c in server.calls)
    sources = {parse_edit_prompt(p).source for p in PROMPTS}
    assert {tuple(np.asarray(c["images"][0]).ravel()[:64]) for c in server.calls} == {
        tuple(np.asarray(load_source(s, 32)).ravel()[:64]) for s in sources}


def test_judges_that_cannot_judge_an_edit_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="cannot judge an edit"):
        check_judges_take_prompts([rewards.load("shapes-oracle")], PROMPTS, "--reward")
    check_judges_take_prompts([rewards.load("shapes-edit-oracle"), rewards.load("jpeg-compressibility")], PROMPTS, "--reward")
    one_image = rewards.load("openai:fake-model", base_url="http://127.0.0.1:9", mode="single")
    one_image.multi_image = False  # as a local VLM that looks at one image per question
    with pytest.raises(ConfigError, match="one image per question"):
        check_judges_take_prompts([one_image], PROMPTS, "--reward")


def png(level: int) -> bytes:
    return encode_png(target_scene_image(PROMPTS[0]).point(lambda v: min(255, v + level)))


@pytest.mark.parametrize("schema", ["pick-a-pic-edit", "editreward"])
def test_edit_preference_pairs_read_as_pairs_with_edit_prompt_captions(schema, tmp_path, monkeypatch):
    monkeypatch.setenv("T2I_ALIGN_EDIT_SOURCES", str(tmp_path / "sources"))
    source = encode_png(load_source(parse_edit_prompt(PROMPTS[0]).source, 32))
    if schema == "pick-a-pic-edit":
        rows = [{"caption": "make it bright", "source": source, "jpg_0": png(10 * i), "jpg_1": png(100),
                 "label_0": float(i % 2), "label_1": float(1 - i % 2)} for i in range(3)]
    else:
        votes = ["leftvote", "rightvote", "tie"]
        rows = [{"instruction": "make it bright", "source_img": source, "left_output_image": png(10 * i),
                 "right_output_image": png(100), "vote_type": votes[i]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    table = open_pairs(str(tmp_path / "pairs.parquet"))
    ties = 1 if schema == "editreward" else 0  # EditReward's "tie" vote; the Pick-a-Pic-like rows have none
    assert (table.stats.kept, table.stats.ties_dropped) == (3 - ties, ties)
    edit = parse_edit_prompt(table.caption(0))
    assert edit is not None and edit.instruction == "make it bright"
    assert np.array_equal(np.asarray(load_source(edit.source)), np.asarray(load_source(parse_edit_prompt(PROMPTS[0]).source, 32)))
    assert len(list((tmp_path / "sources").iterdir())) == 1  # one source image, written once


def test_change_outside_the_edit_is_zero_for_a_perfect_edit_and_counts_anything_else():
    prompts = sample_edit_prompts(20, seed=3)
    perfect = torch.stack([torch.from_numpy(np.asarray(target_scene_image(p), dtype=np.float32) / 255).permute(2, 0, 1)
                           for p in prompts])
    values, region = change_outside_edit(prompts, perfect)
    assert region == INSTRUCTION_CELLS and values.max() < 1e-6
    smeared = perfect.clone()
    smeared[:, :, :3, :3] = 1.0  # a white corner: outside the instruction's cells unless the object sits there
    assert change_outside_edit(prompts, smeared)[0].mean() > 0.001
    other = [edit_prompt("shapes:red circle 0,0", "make the red circle blue")] * 2
    assert change_outside_edit(other, perfect[:2])[1] == INSTRUCTION_CELLS
    assert change_outside_edit(["a red circle"], perfect[:1]) is None
