"""align.data.feedback: K images per prompt, judged, written as Pick-a-Pic pairs; resume and crash safety."""

import json
import math
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from diffusers import StableDiffusionPipeline
from PIL import Image

import align.data.feedback as feedback
import rewards
from align.data.feedback import (
    derive_seed,
    feedback_schema,
    generate_feedback,
    make_pipeline_generator,
    pairwise_scheme,
)
from align.data.pair_stream import load_pairs
from align.data.pairs import DataError
from align.data.sealed_parquet import DIGEST_KEY
from align.testing.tiny_sd import build_tiny_pipeline
from rewards.images import decode_image
from rewards.rules import jpeg_size_kb

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a cat", "a dog"]


class FakeGenerator:
    """Draws a coloured square on noise from the seed alone; counts what it was asked for."""
    def __init__(self, fail_after_calls: int | None = None):
        self.calls: list[tuple[list[str], list[int]]] = []
        self.fail_after_calls = fail_after_calls

    def __call__(self, prompts, seeds):
        if self.fail_after_calls is not None and len(self.calls) >= self.fail_after_calls:
            raise RuntimeError("simulated crash")
        self.calls.append((list(prompts), list(seeds)))
        return [self.draw(seed) for seed in seeds]

    @staticmethod
    def draw(seed: int) -> Image.Image:
        rng = random.Random(seed)
        noise_level = rng.choice([0, 20, 60, 120])  # different JPEG sizes, so the judge has an opinion
        pixels = np.random.default_rng(seed).integers(0, noise_level + 1, (16, 16, 3))
        pixels[4:12, 4:12] = [rng.randrange(256) for _ in range(3)]
        return Image.fromarray(pixels.astype(np.uint8))

    def prompt_indices_seen(self) -> list[str]:
        return [p for prompts, _ in self.calls for p in prompts]


def read(path):
    return pq.read_table(path).to_pylist()


def test_pointwise_judge_best_vs_worst(tmp_path):
    out = tmp_path / "run" / "feedback" / "pairs.parquet"
    judge = rewards.load("jpeg-compressibility")
    generate = FakeGenerator()
    stats = generate_feedback(
        generate, judge, PROMPTS, out, images_per_prompt=4, seed=3, batch_prompts=2, progress=False
    )
    assert pq.read_schema(out).names == feedback_schema().names
    rows = read(out)
    assert sorted(r["prompt_index"] for r in rows) == [0, 1, 2, 3, 4]
    assert (stats.labelled, stats.skipped, stats.pairs, stats.images_generated) == (5, 0, 5, 20)
    assert [len(seeds) for _, seeds in generate.calls] == [8, 8, 4]  # batches of 2, 2, 1 prompts x 4 images
    for row in rows:
        i = row["prompt_index"]
        assert (
            row["caption"] == PROMPTS[i] and row["judge"] == "jpeg-compressibility" and not row["abstained"]
        )
        all_seeds = [derive_seed(3, i, k) for k in range(4)]
        # seeds are recorded and reproduce the stored (lossless PNG) images exactly
        assert row["seed_0"] in all_seeds and row["seed_1"] in all_seeds
        for name, seed in (("jpg_0", row["seed_0"]), ("jpg_1", row["seed_1"])):
            assert np.array_equal(np.asarray(decode_image(row[name])), np.asarray(FakeGenerator.draw(seed)))
        # the pair is the best and the worst of the K scores, and the labels agree with the judge
        raw = json.loads(row["judge_raw"])
        scores = (-jpeg_size_kb([FakeGenerator.draw(s) for s in all_seeds])).tolist()
        assert raw["scores"] == pytest.approx(scores)
        score_0, score_1 = scores[all_seeds.index(row["seed_0"])], scores[all_seeds.index(row["seed_1"])]
        assert {score_0, score_1} == {max(scores), min(scores)}
        if score_0 == score_1:
            assert row["label_0"] == row["label_1"] == 0.5
        else:
            assert (
                row["label_0"] == (1.0 if score_0 > score_1 else 0.0) and row["label_1"] == 1 - row["label_0"]
            )
    assert {r["label_0"] for r in rows} == {0.0, 1.0}  # both orders occur, so load_pairs must swap some
    # the file is a valid training source, winner first
    pairs, pair_stats = load_pairs(str(out))
    assert pair_stats.total == 5 and pair_stats.unreadable == 0
    for pair in pairs:
        assert -jpeg_size_kb([decode_image(pair.chosen)]) > -jpeg_size_kb([decode_image(pair.rejected)])
    assert not (out.parent / "pairs.parquet.parts").exists()
    assert "5 prompts labelled" in stats.summary()


def test_pointwise_judge_all_pairs(tmp_path):
    out = tmp_path / "pairs.parquet"
    judge = rewards.load("jpeg-compressibility")
    stats = generate_feedback(
        FakeGenerator(), judge, PROMPTS[:2], out, images_per_prompt=4, seed=3, progress=False, pairing="all"
    )
    rows = read(out)
    assert stats.pairs == len(rows) == 2 * 6  # K(K-1)/2 pairs per prompt
    for i in range(2):
        seeds = [derive_seed(3, i, k) for k in range(4)]
        own = [r for r in rows if r["prompt_index"] == i]
        assert sorted((seeds.index(r["seed_0"]), seeds.index(r["seed_1"])) for r in own) == [
            (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)
        ]
        scores = (-jpeg_size_kb([FakeGenerator.draw(s) for s in seeds])).tolist()
        for r in own:
            s0, s1 = scores[seeds.index(r["seed_0"])], scores[seeds.index(r["seed_1"])]
            assert r["label_0"] == (0.5 if s0 == s1 else float(s0 > s1))
    with pytest.raises(DataError, match="pairing"):
        generate_feedback(FakeGenerator(), judge, PROMPTS, tmp_path / "x.parquet", pairing="some", progress=False)


def test_ties_are_labelled_half(tmp_path):
    class SameImage(FakeGenerator):
        def __call__(self, prompts, seeds):
            return [Image.new("RGB", (8, 8), "red") for _ in seeds]

    out = tmp_path / "ties.parquet"
    stats = generate_feedback(
        SameImage(), rewards.load("jpeg-compressibility"), PROMPTS[:2], out, progress=False
    )
    rows = read(out)
    assert stats.ties == 2 and all(r["label_0"] == r["label_1"] == 0.5 for r in rows)
    with pytest.raises(DataError, match="2 ties dropped"):
        load_pairs(str(out))


def test_pairwise_judge_adjacent_pairs(tmp_path):
    out = tmp_path / "pw.parquet"
    judge = rewards.load("first-image")
    assert judge.pairwise_native and pairwise_scheme(4) == [(0, 1), (2, 3)]
    stats = generate_feedback(
        FakeGenerator(), judge, PROMPTS[:3], out, images_per_prompt=4, seed=1, progress=False
    )
    rows = read(out)
    assert len(rows) == 6 and stats.pairs == 6
    for row in rows:
        i = row["prompt_index"]
        k0 = [derive_seed(1, i, k) for k in range(4)].index(row["seed_0"])
        assert row["seed_1"] == derive_seed(1, i, k0 + 1) and k0 in (0, 2)
        assert (row["label_0"], row["label_1"]) == (1.0, 0.0)  # the judge always prefers the first image
        assert json.loads(row["judge_raw"]) == {"prob_0": 1.0, "tie": False, "raw": "always first"}
    with pytest.raises(DataError, match="must be even"):
        generate_feedback(FakeGenerator(), judge, PROMPTS, tmp_path / "odd.parquet", images_per_prompt=3)


def test_a_judge_with_only_compare_gets_adjacent_pairs_too(tmp_path):
    class DarkerWins(rewards.Judge):  # no score(), and pairwise_native left False
        def compare(self, prompts, images_a, images_b):
            return [rewards.Preference(1.0 if jpeg_size_kb([a]) < jpeg_size_kb([b]) else 0.0)
                    for a, b in zip(images_a, images_b)]

    out = tmp_path / "compare-only.parquet"
    stats = generate_feedback(FakeGenerator(), DarkerWins(name="compare-only"), PROMPTS[:2], out, images_per_prompt=2, progress=False)
    rows = read(out)
    assert stats.pairs == 2 and len(rows) == 2 and not any(row["abstained"] for row in rows)


def test_abstentions_recorded_but_not_training_pairs(tmp_path):
    class Abstains(rewards.Judge):
        abstains = True  # its NaN scores are abstentions (a judge that does not say so may not return NaN)

        def score(self, prompts, images):
            scores = -jpeg_size_kb(images)
            scores[:3] = float("nan")  # prompt 0: no usable score at all -> abstention
            scores[3] = float("nan")  # prompt 1: image 0 unscored, images 1 and 2 still form a pair
            return scores

    out = tmp_path / "abst.parquet"
    judge = Abstains(name="flaky")
    stats = generate_feedback(
        FakeGenerator(), judge, PROMPTS[:2], out, images_per_prompt=3, batch_prompts=2, progress=False
    )
    rows = sorted(read(out), key=lambda r: r["prompt_index"])
    assert stats.abstained == 1 and rows[0]["abstained"] and math.isnan(rows[0]["label_0"])
    assert not rows[1]["abstained"]
    assert {rows[1]["seed_0"], rows[1]["seed_1"]} == {derive_seed(0, 1, 1), derive_seed(0, 1, 2)}
    pairs, pair_stats = load_pairs(str(out))
    assert [p.source_index for p in pairs] == [1] and pair_stats.unlabelled == 1


def test_resume_skips_labelled_prompts(tmp_path):
    out = tmp_path / "fb.parquet"
    judge = rewards.load("jpeg-compressibility")
    first = FakeGenerator()
    generate_feedback(first, judge, PROMPTS[:3], out, seed=7, batch_prompts=2, progress=False)
    before = read(out)
    again = FakeGenerator()
    stats = generate_feedback(again, judge, PROMPTS[:3], out, seed=7, batch_prompts=2, progress=False)
    assert again.calls == [] and (stats.labelled, stats.skipped) == (0, 3) and read(out) == before
    # more prompts appended: only the new ones are generated
    more = FakeGenerator()
    stats = generate_feedback(more, judge, PROMPTS, out, seed=7, batch_prompts=2, progress=False)
    assert more.prompt_indices_seen() == [PROMPTS[3]] * 2 + [PROMPTS[4]] * 2
    assert (stats.labelled, stats.skipped) == (2, 3)
    assert sorted(r["prompt_index"] for r in read(out)) == [0, 1, 2, 3, 4]
    assert read(out)[:3] == before


def test_resume_refuses_other_prompts_or_seed(tmp_path):
    out = tmp_path / "fb.parquet"
    judge = rewards.load("jpeg-compressibility")
    generate_feedback(FakeGenerator(), judge, PROMPTS[:2], out, seed=0, progress=False)
    with pytest.raises(DataError, match="another prompt list"):
        generate_feedback(FakeGenerator(), judge, ["other", "prompts"], out, progress=False)
    with pytest.raises(DataError, match="another seed"):
        generate_feedback(FakeGenerator(), judge, PROMPTS[:2], out, seed=1, progress=False)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a feedback parquet"):
        generate_feedback(FakeGenerator(), judge, PROMPTS, tmp_path / "junk.parquet", progress=False)
    with pytest.raises(DataError, match="at least 2"):
        generate_feedback(FakeGenerator(), judge, PROMPTS, tmp_path / "x.parquet", images_per_prompt=1)


@pytest.mark.parametrize("damage", ["edited", "unsealed"])
def test_a_feedback_file_edited_or_without_its_seal_is_refused(tmp_path, damage):
    """Issue 61: the feedback a run trains on is the feedback its judge gave. A label flipped by hand (the file
    rewritten by pyarrow, its metadata kept), or a file without the digest of its rows, is refused in one line."""
    out = tmp_path / "fb.parquet"
    judge = rewards.load("jpeg-compressibility")
    generate_feedback(FakeGenerator(), judge, PROMPTS[:2], out, seed=0, progress=False)
    table = pq.read_table(out)
    if damage == "edited":  # the old seal carried over into the edited file
        sealed = pq.ParquetFile(out).metadata.metadata[DIGEST_KEY]
        flipped = pa.array([1.0 - v for v in table.column("label_0").to_pylist()], pa.float64())
        table = table.set_column(table.schema.get_field_index("label_0"), "label_0", flipped)
        with pq.ParquetWriter(out, table.schema) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata({DIGEST_KEY: sealed})
    else:
        pq.write_table(table, out)
    says = "carries no digest" if damage == "unsealed" else "has changed since it was written"
    with pytest.raises(DataError, match=f"feedback file .*{says}.*delete"):
        generate_feedback(FakeGenerator(), judge, PROMPTS[:2], out, seed=0, progress=False)


def test_crash_mid_run_keeps_written_batches_and_rerun_completes(tmp_path):
    out = tmp_path / "fb.parquet"
    judge = rewards.load("jpeg-compressibility")
    crashing = FakeGenerator(fail_after_calls=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        generate_feedback(crashing, judge, PROMPTS, out, seed=5, batch_prompts=2, progress=False)
    # the two finished batches (4 prompts) are in a readable parquet
    assert sorted(r["prompt_index"] for r in read(out)) == [0, 1, 2, 3]
    rerun = FakeGenerator()
    stats = generate_feedback(rerun, judge, PROMPTS, out, seed=5, batch_prompts=2, progress=False)
    assert rerun.prompt_indices_seen() == [PROMPTS[4]] * 2 and (stats.labelled, stats.skipped) == (1, 4)
    assert sorted(r["prompt_index"] for r in read(out)) == [0, 1, 2, 3, 4]


def test_killed_run_shards_are_merged_on_rerun(tmp_path, monkeypatch):
    """A hard kill (no finally) leaves shards in <out>.parts/; the next run folds them in."""
    out = tmp_path / "fb.parquet"
    judge = rewards.load("jpeg-compressibility")
    monkeypatch.setattr(feedback, "_merge_parts", lambda path: None)  # as if killed before any merge
    with pytest.raises(RuntimeError):
        generate_feedback(
            FakeGenerator(fail_after_calls=1), judge, PROMPTS, out, seed=2, batch_prompts=2, progress=False
        )
    monkeypatch.undo()
    assert not out.exists() and len(list((tmp_path / "fb.parquet.parts").glob("part-*.parquet"))) == 1
    rerun = FakeGenerator()
    stats = generate_feedback(rerun, judge, PROMPTS, out, seed=2, batch_prompts=2, progress=False)
    assert stats.skipped == 2 and PROMPTS[0] not in rerun.prompt_indices_seen()
    assert sorted(r["prompt_index"] for r in read(out)) == [0, 1, 2, 3, 4]
    assert not (tmp_path / "fb.parquet.parts").exists()


def test_make_pipeline_generator_seeds_each_image(tmp_path):
    """With the tiny SD pipeline: image i depends on seeds[i] only, whatever batch it is in."""
    pipe = StableDiffusionPipeline.from_pretrained(build_tiny_pipeline(tmp_path))
    pipe.set_progress_bar_config(disable=True)
    generate = make_pipeline_generator(pipe, num_inference_steps=2, guidance_scale=3.0, batch_size=2)
    batch = generate(["a cat", "a dog", "a cow"], [11, 12, 13])
    alone = generate(["a dog"], [12])
    assert len(batch) == 3 and all(isinstance(img, Image.Image) for img in batch)
    assert batch[0].size == (16, 16)
    diff = np.abs(np.asarray(batch[1], dtype=int) - np.asarray(alone[0], dtype=int)).max()
    assert diff <= 1  # same seed, same image (up to rounding of batched float maths)
    other = np.abs(
        np.asarray(batch[1], dtype=int) - np.asarray(generate(["a dog"], [99])[0], dtype=int)
    ).max()
    assert other > 1
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(["a"], [1, 2])
