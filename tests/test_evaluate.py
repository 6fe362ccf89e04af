"""align.eval.evaluate end to end on two tiny models, plus prompt sets."""

import json
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch
from script_loader import load_script
from transformers import CLIPProcessor

import rewards
from align import metrics
from align.cli import ConfigError
from align.data.prompt_sets import PromptSetError, load_prompt_set
from align.eval import evaluate as ev
from align.eval.generation import GenerationCache, ModelEntry, sample_seed
from align.eval.report import format_value
from align.judges import split_list
from align.pipeline import save_full_unet
from align.testbed.models import build_pipeline, build_shapes_clip, shapes_clip_image_processor
from align.testbed.scene import render, sample_captions
from align.testbed.tokenizer import testbed_tokenizer
from rewards.images import to_tensor


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """A random testbed-architecture pipeline (the base) and a UNet folder with perturbed weights."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    pipe = build_pipeline(testbed_tokenizer())
    pipe.save_pretrained(root / "base")
    with torch.no_grad():
        pipe.unet.conv_out.bias.add_(0.5)
    save_full_unet(pipe.unet, root / "tuned")
    return root / "base", root / "tuned"


class TableParser(HTMLParser):
    """Rows of the table with a given id, as lists of cell texts."""
    def __init__(self, table_id):
        super().__init__()
        self.table_id, self.inside, self.rows, self.cell = table_id, False, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("id") == self.table_id:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def _config(tmp_path, base, tuned, judges="jpeg-compressibility,first-image", **kw):
    return ev.EvalConfig(
        models=f"base={base},tuned={tuned}",
        judges=judges,
        prompts="testbed",
        num_prompts=3,
        seeds="0,1",
        num_inference_steps=2,
        guidance_scale=3.0,
        batch_size=4,
        device="cpu",
        fid_reference="testbed",
        fid_feature="pixels",
        output_dir=str(tmp_path / "eval"),
        **kw,
    )


def test_evaluate_two_tiny_models_report_matches_results(tmp_path, two_models, monkeypatch):
    base, tuned = two_models
    results = ev.evaluate(_config(tmp_path, base, tuned))
    out = tmp_path / "eval"
    saved = json.loads((out / "results.json").read_text())
    assert saved["table"] == json.loads(json.dumps(results["table"]))
    assert [m["images_generated"] for m in saved["models"]] == [6, 6]

    # the rank table in the HTML shows exactly the numbers in results.json
    parser = TableParser("rank-table")
    parser.feed((out / "report.html").read_text())
    header, *rows = parser.rows
    assert header == list(saved["table"][0].keys())
    assert len(rows) == 2
    for html_row, row in zip(rows, saved["table"]):
        assert html_row == [format_value(row[c]) for c in header]
    assert rows[1][header.index("avg rank (all judges)")] == format_value(saved["overall"]["tuned"]["avg_rank"])

    # the CSV holds the same table
    csv = pd.read_csv(out / "results.csv")
    assert list(csv.columns) == header
    assert csv["jpeg-compressibility mean"].tolist() == pytest.approx([r["jpeg-compressibility mean"] for r in saved["table"]])

    # recompute the pointwise judge's numbers by hand from the cached PNGs

    judge = rewards.load("jpeg-compressibility")
    prompts = [p for _ in saved["seeds"] for p in saved["prompts"]]
    cache = {m: GenerationCache(out / "generations", ModelEntry(m, p), saved["sampling"], str(base))
             for m, p in (("base", str(base)), ("tuned", str(tuned)))}
    items = [(p, s) for s in saved["seeds"] for p in saved["prompts"]]
    scores = {m: judge.score(prompts, c.load(items)).numpy() for m, c in cache.items()}
    jpeg = saved["judges"]["jpeg-compressibility"]
    assert jpeg["per_model"]["tuned"]["mean"] == pytest.approx(scores["tuned"].mean(), abs=1e-5)
    wins = (scores["tuned"] > scores["base"]).sum() + 0.5 * (scores["tuned"] == scores["base"]).sum()
    assert jpeg["per_model"]["tuned"]["win_rate"]["rate"] == pytest.approx(wins / 6)
    per_prompt = np.stack([scores["base"], scores["tuned"]]).reshape(2, 2, 3).mean(axis=1)
    ranks = metrics.ranks_per_prompt(per_prompt)
    assert jpeg["per_model"]["base"]["avg_rank"] == pytest.approx(ranks[0].mean())
    assert jpeg["per_model"]["base"]["first_share"] + jpeg["per_model"]["tuned"]["first_share"] == pytest.approx(1.0)

    # a pairwise-only judge: first-image always prefers image A; with shuffled order the result is a coin flip
    first = saved["judges"]["first-image"]
    assert first["mode"] == "pairwise" and first["per_model"]["tuned"]["win_rate"]["ties"] == 0
    # FID with pixel features against the true testbed scenes: finite, and the two models differ
    assert np.isfinite(saved["fid"]["base"]) and saved["fid"]["base"] != saved["fid"]["tuned"]

    # every image of the report is embedded and decodes; in headless Chromium none is broken
    checker = load_script("check_report_in_browser")
    total, problems = checker.static_problems(out / "report.html")
    assert problems == [] and total == 3 + 3 * 2  # plots (2 win rates, avg rank) + the 3 x 2 image grid
    if checker.find_browser():
        assert checker.check_report(out / "report.html", tmp_path / "shot.png")["images"] == total

    # adding a judge re-uses every cached image: no pipeline is loaded again
    def no_loading(*args, **kwargs):
        raise AssertionError("images were regenerated")

    monkeypatch.setattr("align.pipeline.load_trained", no_loading)
    again = ev.evaluate(_config(tmp_path, base, tuned, judges="jpeg-compressibility,jpeg-incompressibility,random"))
    assert [m["images_generated"] for m in again["models"]] == [0, 0]
    assert again["judges"]["jpeg-compressibility"]["per_model"] == saved["judges"]["jpeg-compressibility"]["per_model"]
    assert "jpeg-incompressibility" in again["judges"]


def test_bad_inputs_fail_before_any_work(tmp_path, two_models):
    base, tuned = two_models
    with pytest.raises(ConfigError, match="unknown judge"):
        ev.check_inputs(_config(tmp_path, base, tuned, judges="no-such-judge"))
    with pytest.raises(ConfigError, match="seeds"):
        ev.check_inputs(ev.EvalConfig(models=str(base), judges="random", seeds="0,x", prompts="testbed"))
    with pytest.raises(ConfigError, match="no such folder"):
        ev.check_inputs(ev.EvalConfig(models=f"{base},{tmp_path}/missing", judges="random", prompts="testbed"))
    with pytest.raises(ConfigError, match="two models are named"):
        ev.parse_models(f"{base},{base}")
    assert split_list("shapes-oracle[noise=0.2,seed=1],random") == ["shapes-oracle[noise=0.2,seed=1]", "random"]


@pytest.mark.parametrize("judge, message", [("gpt4o", "OPENAI_API_KEY"), ("shapes-oracle[nosie=0.2]", "has no option 'nosie'")])
def test_an_unusable_judge_stops_the_command_before_anything_is_written(tmp_path, two_models, capsys, monkeypatch, judge, message):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    base, tuned = two_models
    out = tmp_path / "eval-out"
    with pytest.raises(SystemExit) as exit_:
        ev.main(["--models", f"base={base},tuned={tuned}", "--judges", f"random,{judge}", "--prompts", "testbed",
                 "--num_prompts", "2", "--seeds", "0", "--fid_reference", "", "--cmmd", "false", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("error:") == 1 and message in err and "Traceback" not in err
    assert not out.exists()


def test_same_prompt_and_seed_give_the_same_noise_for_every_model():
    assert sample_seed(0, "a circle") == sample_seed(0, "a circle")
    assert sample_seed(0, "a circle") != sample_seed(1, "a circle")
    assert sample_seed(0, "a circle") != sample_seed(0, "a square")


def test_bundled_prompt_sets_cover_mjbench_categories():
    full = load_prompt_set("mjbench")
    tops = {c.split("/")[0] for c in full.categories}
    assert tops == {"alignment", "safety", "quality", "bias"}
    assert len(load_prompt_set("mjbench-alignment")) < len(full)
    assert len(load_prompt_set("mjbench", num_prompts=5)) == 5
    testbed = load_prompt_set("testbed", num_prompts=8)
    assert len(testbed) == 8 and set(testbed.categories) <= {"object", "attribute", "count", "spatial"}
    animals = load_prompt_set("animals")
    assert len(animals) == 45 and len(set(animals.prompts)) == 45 and "cat" in animals.prompts
    with pytest.raises(PromptSetError, match="known sets"):
        load_prompt_set("no-such-set")


def test_hub_prompt_sets_load_offline_from_a_file_in_the_same_schema(tmp_path):
    pd.DataFrame({"Prompt": ["a cat", "a dog"], "Category": ["Animals", "Animals"], "Challenge": ["Basic"] * 2}).to_csv(
        tmp_path / "PartiPrompts.tsv", sep="\t", index=False
    )
    parti = load_prompt_set(f"parti[source={tmp_path / 'PartiPrompts.tsv'}]")
    assert parti.prompts == ["a cat", "a dog"] and parti.categories == ["Animals", "Animals"]
    pd.DataFrame({"Prompts": ["x", "y", "z"], "Category": ["Colors", "Text", "Text"]}).to_parquet(tmp_path / "db.parquet")
    assert load_prompt_set(f"drawbench[source={tmp_path / 'db.parquet'}]", num_prompts=2).prompts == ["x", "y"]
    pd.DataFrame({"caption": ["p1", "p2"], "jpg_0": [b"", b""]}).to_parquet(tmp_path / "pick.parquet")
    assert load_prompt_set(f"pickapic-val[source={tmp_path / 'pick.parquet'}]").prompts == ["p1", "p2"]
    (tmp_path / "anime.json").write_text(json.dumps(["an anime cat", "an anime dog"]))
    hps = load_prompt_set(f"hpsv2-anime[source={tmp_path / 'anime.json'}]")
    assert hps.prompts == ["an anime cat", "an anime dog"] and hps.categories == ["anime", "anime"]
    (tmp_path / "all.json").write_text(json.dumps({"anime": ["a"], "photo": ["b", "c"]}))
    assert load_prompt_set(f"hpsv2[source={tmp_path / 'all.json'}]").categories == ["anime", "photo", "photo"]
    pd.DataFrame({"text2": ["x"]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(PromptSetError, match="Prompts"):
        load_prompt_set(f"drawbench[source={tmp_path / 'bad.parquet'}]")


def test_compare_judges_gives_every_judge_the_same_trainer_budget(tmp_path):
    cj = load_script("compare_judges")
    (tmp_path / "dpo.yaml").write_text("max_steps: 50\nlearning_rate: 0.001\nfinetune: lora\n")
    config = cj.CompareConfig(trainer_config=str(tmp_path / "dpo.yaml"), trainer_overrides="lora_rank=2,beta=100", max_steps=7)
    configs = [cj.trainer_config(config, spec, tmp_path / spec, tmp_path / f"{spec}.parquet")[1] for spec in ("shapes-oracle", "random")]
    for dpo, spec in zip(configs, ("shapes-oracle", "random")):
        assert (dpo.max_steps, dpo.learning_rate, dpo.finetune, dpo.lora_rank, dpo.beta) == (7, 0.001, "lora", 2, 100)
        assert dpo.dataset == str(tmp_path / f"{spec}.parquet") and dpo.reward is None and dpo.report_to == "none"
    bad = cj.CompareConfig(trainer_overrides="no_such_field=1")
    with pytest.raises(ConfigError, match="no_such_field"):
        cj.trainer_config(bad, "random", tmp_path, tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="at least two judges"):
        cj.CompareConfig(judges="random").validate()


def test_fid_and_cmmd_with_shapes_clip_features(tmp_path):
    """The testbed's FID feature network: a CLIP judge's image embeddings (a tiny random CLIP saved
    in the real layout and loaded through rewards.load, as the bundled shapes-clip is)."""
    tokenizer = testbed_tokenizer()
    torch.manual_seed(0)
    build_shapes_clip(tokenizer).save_pretrained(tmp_path / "clip")
    CLIPProcessor(image_processor=shapes_clip_image_processor(), tokenizer=tokenizer).save_pretrained(tmp_path / "clip")
    spec = f"shapes-clip[model={tmp_path / 'clip'}]"
    network = ev.feature_network(spec)
    assert network.num_features == 64
    captions = sample_captions(24, seed=3)
    scenes = to_tensor([render(c, seed=i) for i, c in enumerate(captions)])
    stats = metrics.FeatureStats(network)
    stats.add_reference(scenes)
    assert abs(stats.fid(scenes)) < 1e-3
    assert stats.fid(1 - scenes) > 1e-2  # inverted colours are far from the scenes
    embed = ev.embedding_function(spec)
    assert metrics.cmmd(embed(scenes), embed(scenes)) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ConfigError, match="no image embeddings"):
        ev.feature_network("jpeg-compressibility")


def test_testbed_reference_at_a_size_it_cannot_render_is_one_line():
    with pytest.raises(ev.ConfigError, match=r"--fid_reference testbed renders scenes of 24 to .* these images are 16 px"):
        ev.load_reference_images("testbed", ["a red circle"], [0], 16)
    assert ev.load_reference_images("testbed", ["a red circle"], [0], 24).shape == (1, 3, 24, 24)


def test_inception_fid_without_torch_fidelity_is_refused_before_any_image(two_models, tmp_path, capsys, monkeypatch):
    """Issue 61 finding 7: --fid_reference with the default Inception features and no torch-fidelity ended in a
    RuntimeError traceback; now one line before any model loads or image is generated."""
    real = ev.importlib.util.find_spec
    monkeypatch.setattr(ev.importlib.util, "find_spec", lambda name: None if name == "torch_fidelity" else real(name))
    base, tuned = two_models
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exit_:
        ev.main(["--models", f"base={base},tuned={tuned}", "--judges", "shapes-oracle", "--prompts", "testbed",
                 "--num_prompts", "2", "--seeds", "0", "--fid_reference", "testbed", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "torch-fidelity" in line and "--fid_feature" in line
    assert not out.exists()
