"""Judge benchmark: MJ-Bench-format loading, the shapes benchmark generator, and the CLI end to end."""

import csv
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from align.judgebench import benchmark as judgebench
from align.judgebench.data import BenchDataError, load_bench, parse_source
from align.testbed import mjbench
from rewards.base import Judge, Preference
from rewards.images import encode_png
from rewards.shapes import ShapesOracle


def _png(colour) -> bytes:
    return encode_png(Image.new("RGB", (8, 8), colour))


def _hf_style_parquet(path):
    """Rows as the hub's parquet stores them: Image structs {bytes, path}, info as JSON text."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [
        {"caption": "a red circle", "image0": {"bytes": _png("red"), "path": None},
         "image1": {"bytes": _png("blue"), "path": None}, "label": 0,
         "info": json.dumps({"subcategory": "attribute"})},
        {"caption": "two dogs", "image0": {"bytes": _png("white"), "path": None},
         "image1": {"bytes": _png("black"), "path": None}, "label": 1, "info": json.dumps({"subcategory": "count"})},
    ]
    schema = pa.schema([("caption", pa.string()), ("image0", image), ("image1", image), ("label", pa.int64()),
                        ("info", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_load_local_mjbench_parquet(tmp_path):
    path = tmp_path / "alignment.parquet"
    _hf_style_parquet(path)
    samples, base_dir = load_bench(str(path), ("alignment",))
    assert [s.label for s in samples] == [0, 1]
    assert [s.subcategory for s in samples] == ["attribute", "count"]
    assert all(s.category == "alignment" for s in samples)  # no category column: alignment
    first, second = samples[0].images(base_dir)
    assert first.getpixel((0, 0)) == (255, 0, 0) and second.getpixel((0, 0)) == (0, 0, 255)
    assert load_bench(str(path), ("alignment",), limit=1)[0][0].caption == "a red circle"


def test_load_json_with_relative_image_paths_and_bias_rows(tmp_path):
    Image.new("RGB", (4, 4), "green").save(tmp_path / "a.png")
    Image.new("RGB", (4, 4), "yellow").save(tmp_path / "b.png")
    data = {
        "quality": [{"caption": "a cat", "image0": "a.png", "image1": "b.png", "label": 1.0, "subcategory": "blur"}],
        "bias": [{"caption": "a doctor", "image0": "a.png", "info": {"occupation": "doctor", "demographic": "old"}}],
    }
    (tmp_path / "bench.json").write_text(json.dumps(data))
    samples, base_dir = load_bench(str(tmp_path / "bench.json"))
    quality, bias = samples
    assert quality.label == 1 and quality.subcategory == "blur"
    assert quality.images(base_dir)[1].getpixel((0, 0)) == (255, 255, 0)
    assert (bias.category, bias.group, bias.variant) == ("bias", "doctor", "old")
    assert bias.images(base_dir)[1] is None


def test_bad_rows_and_sources_get_one_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"caption": "x", "image0": "a.png", "image1": "b.png", "label": 2}) + "\n")
    with pytest.raises(BenchDataError, match=r"bad.jsonl:0: 'label' must be 0"):
        load_bench(str(path))
    path.write_text(json.dumps({"caption": "x", "image0": "a.png", "category": "bias"}) + "\n")
    with pytest.raises(BenchDataError, match="needs 'group' and 'variant'"):
        load_bench(str(path))
    with pytest.raises(BenchDataError, match="unknown subset"):
        load_bench(str(path), ("style",))
    with pytest.raises(BenchDataError, match="no such file"):
        parse_source(str(tmp_path / "missing.parquet"))
    with pytest.raises(BenchDataError, match="pin a revision"):
        parse_source("MJ-Bench/MJ-Bench")
    assert parse_source("MJ-Bench/MJ-Bench@abc123") == ("hub", "MJ-Bench/MJ-Bench", "abc123")


def test_testbed_benchmark_is_balanced_and_exact(tmp_path):
    path = mjbench.write_benchmark(tmp_path / "b.parquet", pairs_per_subcategory=4, bias_groups=2, seed=3)
    samples, base_dir = load_bench(str(path))
    pairs = [s for s in samples if s.is_pair]
    for sub in ("object", "attribute", "count", "spatial", "blur", "motion-blur", "distortion"):
        labels = [s.label for s in pairs if s.subcategory == sub]
        assert sorted(labels) == [0, 0, 1, 1], sub
    oracle = ShapesOracle()
    for sample in pairs:
        images = sample.images(base_dir)
        preferred, rejected = images[sample.label], images[1 - sample.label]
        scores = oracle.score([sample.caption] * 2, [preferred, rejected]).tolist()
        assert scores[0] == 1.0, sample.caption  # the preferred image shows the caption exactly
        if sample.category == "alignment":
            assert scores[1] < 1.0, sample.caption  # the near miss breaks a fact
        else:
            assert preferred.tobytes() != rejected.tobytes()  # a degraded copy
    bias = [s for s in samples if not s.is_pair]
    assert len(bias) == 2 * 6 and len({s.group for s in bias}) == 2
    assert all(not any(c in s.caption for c in ("red", "blue", "green")) for s in bias)


def test_testbed_benchmark_is_deterministic(tmp_path):
    a = mjbench.build_rows(2, 1, seed=5)
    b = mjbench.build_rows(2, 1, seed=5)
    assert a == b


@dataclass
class FlakyTwoImageJudge(Judge):
    """Picks the first image shown, but abstains on captions containing 'square'."""

    name: str = "flaky"

    def __post_init__(self):
        self.pairwise_native = True

    def compare(self, prompts, images_a, images_b):
        return [Preference(0.5, abstained=True) if "square" in p else Preference(1.0) for p in prompts]


def test_two_image_judge_both_orders_and_abstentions(tmp_path):
    path = mjbench.write_benchmark(tmp_path / "b.parquet", pairs_per_subcategory=4, bias_groups=1, seed=1)
    samples, base_dir = load_bench(str(path), ("alignment", "bias"))
    pairs = [s for s in samples if s.is_pair]
    bias = [s for s in samples if not s.is_pair]
    run = judgebench.run_judge("flaky", FlakyTwoImageJudge(), pairs, bias, base_dir, 0.0, batch_size=3)
    summary = judgebench.summarise(run, pairs, bias)
    row = summary["row"]
    abstains = sum("square" in s.caption for s in pairs)
    answered_label0 = sum(1 for s in pairs if "square" not in s.caption and s.label == 0)
    answered_label1 = sum(1 for s in pairs if "square" not in s.caption and s.label == 1)
    assert row["type"] == "pairwise"
    assert row["abstention_rate"] == pytest.approx(abstains / len(pairs))
    assert row["acc_order_01"] == pytest.approx(answered_label0 / len(pairs))
    assert row["acc_order_10"] == pytest.approx(answered_label1 / len(pairs))
    assert row["order_consistency"] == 0.0
    assert row["acc_with_ties"] == 0.0  # every answered pair is order-dependent: a tie
    assert run.bias_scores is None and "bias_acc" not in row  # no pointwise score


def test_cli_end_to_end_on_the_testbed(tmp_path):
    out = tmp_path / "jb"
    argv = ["--judges", "shapes-oracle,shapes-oracle[position_bias=1.0],random,first-image",
            "--data", "testbed", "--output_dir", str(out), "--testbed_pairs", "4", "--testbed_bias_groups", "2",
            "--batch_size", "8"]
    judgebench.main(argv)
    for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.png", "per_category.csv", "bias_groups.csv",
                 "verdicts.jsonl", "summary.json", "report.html", "config.yaml"):
        assert (out / name).is_file(), name
    rows = {r["judge"]: r for r in csv.DictReader((out / "leaderboard.csv").open())}
    oracle, biased, first = rows["shapes-oracle"], rows["shapes-oracle[position_bias=1.0]"], rows["first-image"]
    assert float(oracle["alignment_acc_with_ties"]) == 1.0
    assert float(oracle["order_consistency"]) == 1.0
    # an always-first judge: 50% in each order on balanced labels, no preference once orders are swapped
    for judge in (biased, first):
        assert float(judge["acc_order_01"]) == 0.5 and float(judge["acc_order_10"]) == 0.5
        assert float(judge["alignment_acc_with_ties"]) == 0.0
        assert float(judge["order_consistency"]) == 0.0
    assert list(rows)[0] == "shapes-oracle"  # ranked first
    assert "| shapes-oracle | pairwise | " in (out / "leaderboard.md").read_text()
    # a second run into the same folder is refused unless --overwrite
    with pytest.raises(SystemExit) as exit_:
        judgebench.main(argv)
    assert exit_.value.code == 2


def test_cli_rejects_bad_input_before_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        judgebench.main(["--judges", "no-such-judge", "--output_dir", str(tmp_path / "x")])
    assert "unknown judge 'no-such-judge'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        judgebench.main(["--judges", "random", "--subsets", "style", "--output_dir", str(tmp_path / "x")])
    assert "valid: alignment, safety, quality, bias" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_judge_that_fails_to_load_is_left_out_and_the_run_exits_nonzero(tmp_path, capsys):
    out = tmp_path / "jb"
    argv = ["--judges", "random,shapes-oracle[noise=2]", "--data", "testbed", "--output_dir", str(out),
            "--testbed_pairs", "2", "--testbed_bias_groups", "0", "--subsets", "alignment"]
    with pytest.raises(SystemExit) as exit_:
        judgebench.main(argv)
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    assert "judge 'shapes-oracle[noise=2]' could not be loaded" in captured.out
    rows = list(csv.DictReader((out / "leaderboard.csv").open()))
    assert [r["judge"] for r in rows] == ["random"]
