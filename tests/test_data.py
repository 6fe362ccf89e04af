"""align.data.pairs: Pick-a-Pic-schema pairs, tie policy, winner-first swap, unreadable images, transforms,
prompt sets."""

import io
import json
import math
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from align.data.pair_stream import PairPixels, PlannedBatches, load_pairs, micro_batch_loader, open_pairs
from align.data.pairs import (
    DataError,
    PairTransform,
    PreferencePair,
    load_prompts,
    pair_pixels,
    write_pairs_parquet,
)


def jpeg(color, size=(24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def gradient_png(width=20, height=12) -> bytes:
    """An image whose pixels all differ, so crops and flips are visible."""
    img = Image.new("RGB", (width, height))
    img.putdata([(x * 12 % 256, y * 20 % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


RED, GREEN, BLUE, WHITE = jpeg("red"), jpeg("green"), jpeg("blue"), jpeg("white")
CORRUPT = b"\xff\xd8\xff\xe0 this is not a jpeg"

# caption, jpg_0, jpg_1, label_0, label_1
ROWS = [
    ("a red cat", RED, GREEN, 1.0, 0.0),  # winner first already
    ("a blue dog", GREEN, BLUE, 0.0, 1.0),  # loser first: must be swapped
    ("a tie", RED, BLUE, 0.5, 0.5),  # tie
    ("broken", CORRUPT, WHITE, 1.0, 0.0),  # unreadable image
    ("white wins", BLUE, WHITE, 0.0, 1.0),
]


def write_rows(path, rows=ROWS, extra=None):
    table = {
        "caption": [r[0] for r in rows],
        "jpg_0": [r[1] for r in rows],
        "jpg_1": [r[2] for r in rows],
        "label_0": [r[3] for r in rows],
        "label_1": [r[4] for r in rows],
        "ranking_id": list(range(len(rows))),  # extra Pick-a-Pic columns are ignored
    }
    table.update(extra or {})
    pq.write_table(pa.table(table), path)
    return path


def test_load_pairs_drops_ties_swaps_and_counts_unreadable(tmp_path):
    pairs, stats = load_pairs(str(write_rows(tmp_path / "pairs.parquet")))
    assert [p.caption for p in pairs] == ["a red cat", "a blue dog", "white wins"]
    assert [p.source_index for p in pairs] == [0, 1, 4]
    assert (pairs[0].chosen, pairs[0].rejected) == (RED, GREEN)
    assert (pairs[1].chosen, pairs[1].rejected) == (BLUE, GREEN)  # swapped: the winner comes first
    assert (pairs[2].chosen, pairs[2].rejected) == (WHITE, BLUE)
    assert (stats.total, stats.kept, stats.ties_dropped, stats.ties_kept, stats.unreadable) == (5, 3, 1, 0, 1)
    assert stats.unreadable_examples[0][0] == 3 and "row 3 jpg_0" in stats.unreadable_examples[0][1]
    summary = stats.summary()
    assert "3 pairs kept" in summary and "1 ties dropped" in summary and "1 with unreadable images" in summary


def test_keep_first_tie_policy_keeps_ties_as_image_0_wins(tmp_path):
    pairs, stats = load_pairs(str(write_rows(tmp_path / "pairs.parquet")), tie_policy="keep_first")
    tie = [p for p in pairs if p.caption == "a tie"][0]
    assert (tie.chosen, tie.rejected) == (RED, BLUE)
    assert (stats.kept, stats.ties_kept, stats.ties_dropped) == (4, 1, 0)


def test_without_validation_corrupt_images_pass_through(tmp_path):
    pairs, stats = load_pairs(str(write_rows(tmp_path / "pairs.parquet")), validate_images=False)
    assert stats.unreadable == 0 and len(pairs) == 4
    broken = [p for p in pairs if p.caption == "broken"][0]
    with pytest.raises(ValueError, match="pair 3 chosen image"):
        pair_pixels(broken, 8)


def test_max_pairs_stops_early(tmp_path):
    pairs, stats = load_pairs(str(write_rows(tmp_path / "pairs.parquet")), max_pairs=2)
    assert len(pairs) == 2 and stats.total == 2


def test_abstained_and_nan_labels_are_not_training_pairs(tmp_path):
    rows = [
        ("ok", RED, GREEN, 1.0, 0.0),
        ("nan", RED, GREEN, math.nan, math.nan),
        ("flag", RED, GREEN, 1.0, 0.0),
    ]
    path = write_rows(tmp_path / "fb.parquet", rows, extra={"abstained": [False, False, True]})
    pairs, stats = load_pairs(str(path))
    assert [p.caption for p in pairs] == ["ok"] and stats.unlabelled == 2


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_pairs(str(tmp_path / "missing.parquet"))
    pq.write_table(pa.table({"caption": ["x"], "jpg_0": [RED]}), tmp_path / "cols.parquet")
    with pytest.raises(DataError, match="lacks the Pick-a-Pic columns jpg_1, label_0, label_1"):
        load_pairs(str(tmp_path / "cols.parquet"))
    bad = write_rows(tmp_path / "bad.parquet", [("b", CORRUPT, RED, 1.0, 0.0), ("t", RED, RED, 0.5, 0.5)])
    with pytest.raises(DataError, match="no usable preference pairs.*1 ties dropped.*1 with unreadable"):
        load_pairs(str(bad))
    with pytest.raises(DataError, match="tie_policy 'coin'.*drop, keep_first"):
        load_pairs(str(bad), tie_policy="coin")
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(DataError, match="holds no .parquet files"):
        load_pairs(str(tmp_path / "empty_folder"))


def test_hf_datasets_paths_offline(tmp_path):
    """A save_to_disk folder with datasets Image columns (dicts with bytes) and a Hub-layout parquet folder."""
    features = datasets.Features(
        caption=datasets.Value("string"),
        jpg_0=datasets.Image(),
        jpg_1=datasets.Image(),
        label_0=datasets.Value("float64"),
        label_1=datasets.Value("float64"),
    )
    data = {
        "caption": [r[0] for r in ROWS],
        "jpg_0": [{"bytes": r[1], "path": None} for r in ROWS],
        "jpg_1": [{"bytes": r[2], "path": None} for r in ROWS],
        "label_0": [r[3] for r in ROWS],
        "label_1": [r[4] for r in ROWS],
    }
    dataset = datasets.Dataset.from_dict(data, features=features)
    datasets.DatasetDict({"train": dataset, "validation": dataset.select([1])}).save_to_disk(
        str(tmp_path / "disk")
    )
    pairs, stats = load_pairs(str(tmp_path / "disk"))
    assert [p.caption for p in pairs] == ["a red cat", "a blue dog", "white wins"] and stats.unreadable == 1
    assert (pairs[1].chosen, pairs[1].rejected) == (BLUE, GREEN)
    pairs, _ = load_pairs(str(tmp_path / "disk"), split="validation")
    assert [p.caption for p in pairs] == ["a blue dog"]
    with pytest.raises(DataError, match="no split 'test'"):
        load_pairs(str(tmp_path / "disk"), split="test")

    (tmp_path / "hub" / "data").mkdir(parents=True)
    write_rows(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    pairs, stats = load_pairs(str(tmp_path / "hub"), cache_dir=str(tmp_path / "cache"))
    assert [p.source_index for p in pairs] == [0, 1, 4] and stats.ties_dropped == 1


def make_pair(caption="a prompt"):
    return PreferencePair(caption, chosen=gradient_png(), rejected=gradient_png(), source_index=7)


def test_transform_same_crop_and_flip_for_both_images_and_range():
    transform = PairTransform(8, random_crop=True, random_flip=True, caption_dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(12):
        caption, pixels_w, pixels_l = transform(make_pair(), generator)
        assert caption == "a prompt"
        assert pixels_w.shape == (3, 8, 8) and pixels_l.shape == (3, 8, 8)
        assert torch.equal(pixels_w, pixels_l)  # identical source images -> identical crops/flips
        assert pixels_w.min() >= -1 and pixels_w.max() <= 1
        seen.add(pixels_w.sum().item())
    assert len(seen) > 2  # crops and flips really vary


def test_transform_is_deterministic_given_the_generator():
    transform = PairTransform(8, random_crop=True, caption_dropout=0.5)
    pair = PreferencePair("c", chosen=gradient_png(), rejected=gradient_png(30, 12), source_index=0)
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(123)
        runs.append([transform(pair, generator) for _ in range(5)])
    for (c1, w1, l1), (c2, w2, l2) in zip(*runs):
        assert c1 == c2 and torch.equal(w1, w2) and torch.equal(l1, l2)


def test_flip_and_centre_crop_match_deterministic_pair_pixels():
    pair = make_pair()
    plain_w, plain_l = pair_pixels(pair, 12, flip=False)
    flipped_w, _ = pair_pixels(pair, 12, flip=True)
    assert torch.equal(flipped_w, plain_w.flip(-1))
    # no random crop: the transform's output is one of the two deterministic centre crops
    transform = PairTransform(12, random_crop=False, random_flip=True, caption_dropout=0.0)
    _, pixels_w, _ = transform(pair, torch.Generator().manual_seed(1))
    assert torch.equal(pixels_w, plain_w) or torch.equal(pixels_w, flipped_w)
    # the centre crop of the 20x12 image keeps columns 4..15
    source = torch.tensor(list(Image.open(io.BytesIO(gradient_png())).getdata()), dtype=torch.float32)
    source = source.view(12, 20, 3).permute(2, 0, 1) / 127.5 - 1
    assert torch.allclose(plain_w, source[:, :, 4:16], atol=1e-6)


def test_caption_dropout_rate():
    transform = PairTransform(8, caption_dropout=0.2)
    generator = torch.Generator().manual_seed(0)
    pair = PreferencePair("c", chosen=jpeg("red", (8, 8)), rejected=jpeg("blue", (8, 8)), source_index=0)
    dropped = sum(transform(pair, generator)[0] == "" for _ in range(1000))
    assert 150 < dropped < 250  # 200 expected; binomial sd ~ 12.6
    with pytest.raises(DataError, match="caption_dropout"):
        PairTransform(8, caption_dropout=1.5)


def test_load_prompts_from_files(tmp_path):
    (tmp_path / "p.txt").write_text("# animals\na cat\n\n  a dog  \n#skip\na cow\n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog", "a cow"]
    pq.write_table(pa.table({"caption": ["x", None, "y"], "other": [1, 2, 3]}), tmp_path / "p.parquet")
    assert load_prompts(str(tmp_path / "p.parquet")) == ["x", "y"]
    (tmp_path / "p.csv").write_text("prompt,id\nhello,1\nworld,2\n")
    assert load_prompts(str(tmp_path / "p.csv"), column="prompt") == ["hello", "world"]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"caption": c}) for c in ["u", "v"]))
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["u", "v"]


def test_load_prompts_from_dataset_folder(tmp_path):
    datasets.Dataset.from_dict({"caption": ["one", "two"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_prompts(str(tmp_path / "ds")) == ["one", "two"]


def test_load_prompts_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompts(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    with pytest.raises(DataError, match="holds no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match="no column 'caption'; its columns: text"):
        load_prompts(str(tmp_path / "p.parquet"))
    with pytest.raises(DataError, match=r"cannot load prompt set 'nobody/prompt-set' \(split 'test'\)"):
        load_prompts("nobody/prompt-set:test")  # tests run offline: the Hub id fails with a clear message
    (tmp_path / "p.yaml").write_text("a: 1")
    with pytest.raises(DataError, match="unsupported type"):
        load_prompts(str(tmp_path / "p.yaml"))


def test_write_pairs_parquet_is_atomic_and_round_trips(tmp_path, monkeypatch):
    path = tmp_path / "out" / "pairs.parquet"
    rows = [{"caption": "c", "jpg_0": RED, "jpg_1": BLUE, "label_0": 0.0, "label_1": 1.0}]
    write_pairs_parquet(rows, path)
    pairs, _ = load_pairs(str(path))
    assert (pairs[0].chosen, pairs[0].rejected) == (BLUE, RED)

    def write_half_then_die(table, where, **kwargs):
        with open(where, "wb") as handle:
            handle.write(b"PAR1 half a file")
        raise KeyboardInterrupt  # e.g. the user stops the run mid-write

    monkeypatch.setattr(pq, "write_table", write_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_pairs_parquet(rows * 2, path)
    monkeypatch.undo()
    assert len(load_pairs(str(path))[0]) == 1  # the old file is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["pairs.parquet"]  # no temporary left


def test_ddpo_and_prompt_loading_do_not_import_pyarrow():
    # pyarrow costs ~30 MB of resident memory; DDPO with a testbed or text prompt source never needs it
    # (the parquet readers import it themselves).

    code = (
        "import sys, align.train.ddpo, align.data.pairs;"
        "from align.data.prompt_sets import load_prompt_list; assert load_prompt_list('testbed:4');"
        "sys.exit('pyarrow' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ------------------------------------------------------------------ streaming: align.data.pair_stream


def test_open_pairs_indexes_labels_only_and_reads_pairs_from_the_mapped_table(tmp_path):
    table = open_pairs(str(write_rows(tmp_path / "pairs.parquet")), cache_dir=str(tmp_path / "cache"))
    # Only the labels are read up front: the unreadable row is a pair until it is used.
    assert list(table.rows) == [0, 1, 3, 4] and list(table.swap) == [False, True, False, True]
    assert (table.stats.total, table.stats.kept, table.stats.ties_dropped) == (5, 4, 1)
    pair = table.pair(1)
    assert (pair.caption, pair.chosen, pair.rejected, pair.source_index) == ("a blue dog", BLUE, GREEN, 1)
    w, l_ = table.pixels(3, 8, flip=False)
    ref_w, ref_l = pair_pixels(PreferencePair("", WHITE, BLUE, 4), 8)
    assert torch.equal(w, ref_w) and torch.equal(l_, ref_l)
    with pytest.raises(DataError, match=r"row 3 holds an unreadable image.*fix or remove that row"):
        table.pixels(2, 8, flip=False)
    kept = open_pairs(str(tmp_path / "pairs.parquet"), tie_policy="keep_first", max_pairs=3, cache_dir=str(tmp_path / "cache"))
    assert list(kept.rows) == [0, 1, 2] and kept.stats.ties_kept == 1 and kept.stats.total == 3
    assert kept.fingerprint != table.fingerprint


def test_open_pairs_from_saved_dataset_and_parquet_folder_offline(tmp_path):
    """save_to_disk folders with datasets Image columns and a Hub-layout parquet folder (a Hub id
    goes through the same load_dataset call but cannot be tested offline)."""
    features = datasets.Features(caption=datasets.Value("string"), jpg_0=datasets.Image(), jpg_1=datasets.Image(),
                                 label_0=datasets.Value("float64"), label_1=datasets.Value("float64"),
                                 abstained=datasets.Value("bool"))
    data = {"caption": [r[0] for r in ROWS], "jpg_0": [{"bytes": r[1], "path": None} for r in ROWS],
            "jpg_1": [{"bytes": r[2], "path": None} for r in ROWS], "label_0": [r[3] for r in ROWS],
            "label_1": [r[4] for r in ROWS], "abstained": [False, False, False, False, True]}
    datasets.Dataset.from_dict(data, features=features).save_to_disk(str(tmp_path / "disk"))
    table = open_pairs(str(tmp_path / "disk"))
    assert list(table.rows) == [0, 1, 3] and table.stats.unlabelled == 1
    assert table.pair(1).chosen == BLUE  # image columns come back as the encoded bytes

    (tmp_path / "hub" / "data").mkdir(parents=True)
    write_rows(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    assert list(open_pairs(str(tmp_path / "hub"), cache_dir=str(tmp_path / "cache")).rows) == [0, 1, 3, 4]


def test_open_pairs_refuses_sources_without_the_pick_a_pic_columns(tmp_path):
    pq.write_table(pa.table({"caption": ["x"], "image": [RED]}), tmp_path / "cols.parquet")
    with pytest.raises(DataError, match=r"cols.parquet' lacks the Pick-a-Pic columns jpg_0, jpg_1, label_0, label_1"):
        open_pairs(str(tmp_path / "cols.parquet"))
    datasets.Dataset.from_dict({"caption": ["x"], "jpg_0": [RED]}).save_to_disk(str(tmp_path / "disk"))
    with pytest.raises(DataError, match=r"lacks the Pick-a-Pic columns jpg_1, label_0, label_1"):
        open_pairs(str(tmp_path / "disk"))
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read .*garbage.parquet as parquet"):
        open_pairs(str(tmp_path / "garbage.parquet"))
    with pytest.raises(DataError, match="no usable preference pairs"):
        open_pairs(str(write_rows(tmp_path / "ties.parquet", rows=[ROWS[2]])), cache_dir=str(tmp_path / "cache"))


def test_planned_batches_restart_at_any_step_and_workers_read_the_same_items(tmp_path):
    table = open_pairs(str(write_rows(tmp_path / "pairs.parquet", rows=[r for r in ROWS if r[0] != "broken"])),
                       cache_dir=str(tmp_path / "cache"))

    def plan(step, micro):
        return [((step * 2 + micro + k) % len(table), (step + k) % 2 == 0, k == 1) for k in range(2)]

    def read(start, workers):
        loader = micro_batch_loader(PairPixels(table, 8), PlannedBatches(plan, start, 4, 2), workers)
        return [(b["pixels_w"], b["pixels_l"], b["caption"]) for b in loader]

    full = read(0, 0)
    assert len(full) == 8 and full[0][2][1] == ""  # caption dropped where planned
    for (w, l_, c), (w2, l2, c2) in zip(full[4:], read(2, 2)):  # resumed at step 2, read by two workers
        assert torch.equal(w, w2) and torch.equal(l_, l2) and c == c2


def test_unreadable_image_reaches_the_trainer_as_one_line(tmp_path):
    table = open_pairs(str(write_rows(tmp_path / "pairs.parquet")), cache_dir=str(tmp_path / "cache"))
    loader = micro_batch_loader(PairPixels(table, 8), PlannedBatches(lambda s, m: [(0, False, False), (2, False, False)], 0, 1, 1), 1)
    (batch,) = list(loader)
    assert batch["error"].count("\n") == 0 and "row 3 holds an unreadable image" in batch["error"]
