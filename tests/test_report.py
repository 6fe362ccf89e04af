"""Report helpers: embedded images, tables, plots; the page opens in headless Chromium."""

import base64
import html as html_lib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from script_loader import load_script

from align.cli import parse_config
from align.eval import report
from align.metrics import clustered_sem, mean_and_sem
from align.train import dpo
from align.train.dpo_config import DPOConfig
from align.train.heldout import save_image_row
from align.train.objectives import nft
from align.train.report import Curve, readable, write_training_report


def _decode_data_uris(text):
    return [
        Image.open(io.BytesIO(base64.b64decode(m)))
        for m in re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    ]


def test_image_grid_tiles_images_in_rows():
    images = torch.zeros(5, 3, 8, 8)
    images[2, 0] = 1.0  # third image red
    grid = report.image_grid(images, ncols=2, pad=1)
    assert grid.size == (2 * 9 + 1, 3 * 9 + 1)
    # third image = row 1, column 0
    assert grid.getpixel((1 + 3, 1 + 9 + 3)) == (255, 0, 0)
    assert grid.getpixel((1 + 9 + 3, 1 + 9 + 3)) == (0, 0, 0)


def test_table_html_escapes_and_formats():
    html = report.table_html([{"model": "<b>x</b>", "score": 0.12345, "n": 3, "missing": float("nan")}], table_id="t")
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>" not in html
    assert ">0.123<" in html and ">3<" in html and ">-<" in html
    assert 'id="t"' in html


def test_grid_html_and_plots_embed_decodable_pngs(tmp_path):
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    grid = report.image_grid_html([[red, None]], ["a prompt"], ["base", "tuned"], width=32)
    plot = report.line_plot({"oracle": ([1, 2, 4], [0.1, 0.2, 0.3]), "clip": ([1, 2, 4], [0.3, 0.2, 0.1], [0.01] * 3)}, logx=True)
    bars = report.bar_plot(["a", "b"], [0.4, 0.6], errors=[[0.1, 0.1], [0.1, 0.1]], reference_line=0.5)
    page = report.write_report(
        tmp_path / "r.html",
        [report.Section("Grid", grid), report.Section("Plots", report.img_tag(plot) + report.img_tag(bars))],
        title="T <1>",
    )
    text = page.read_text()
    assert "<title>T &lt;1&gt;</title>" in text
    images = _decode_data_uris(text)
    assert len(images) == 3
    assert images[0].getpixel((0, 0)) == (255, 0, 0)
    assert images[1].size[0] > 100  # a rendered figure
    with pytest.raises(ValueError, match="row labels"):
        report.image_grid_html([[red]], [], ["base"])


def test_static_check_finds_broken_and_missing_images(tmp_path):
    checker = load_script("check_report_in_browser")
    good = report.img_tag(Image.new("RGB", (4, 4)))
    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    page = tmp_path / "p.html"
    page.write_text(
        f'<html><body>{good}<img src="ok.png"><img src="gone.png"><img src="data:image/png;base64,AAAA"></body></html>'
    )
    total, problems = checker.static_problems(page)
    assert total == 4
    assert len(problems) == 2
    assert any("gone.png" in p for p in problems)


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="headless Chromium is not installed (apt-get install chromium)")
def test_report_opens_in_headless_chromium(tmp_path):
    checker = load_script("check_report_in_browser")
    plot = report.line_plot({"s": ([1, 2], [1, 2])})
    sections = [report.Section("Plot", report.img_tag(plot)), report.Section("Table", report.table_html([{"a": 1.0}]))]
    page = report.write_report(tmp_path / "report.html", sections, title="browser check")
    summary = checker.check_report(page, tmp_path / "shot.png")
    assert summary["images"] == 1 and (tmp_path / "shot.png").is_file()
    # a page with a broken relative image fails in the browser too
    bad = tmp_path / "bad.html"
    bad.write_text(page.read_text().replace("</body>", '<img src="nothing.png" alt="nothing"></body>'))
    status = checker.browser_image_status(bad, checker.find_browser())
    assert status == {"total": 2, "broken": ["nothing"]}


# ------------------------------------------------------------------------------------ a trainer's report

ROOT = Path(__file__).resolve().parent.parent
HAS_CHROMIUM = shutil.which("chromium") is not None or shutil.which("chromium-browser") is not None


def _images_by_alt(text):
    """{alt: decoded image} for every embedded <img> of a page."""
    found = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]*)"', text)
    return {html_lib.unescape(alt): Image.open(io.BytesIO(base64.b64decode(data))) for data, alt in found}


@pytest.fixture(scope="module")
def tiny_dpo_run(tmp_path_factory):
    """A two-step Diffusion-DPO run on the bundled testbed with held-out evaluations before, during and after."""
    out = tmp_path_factory.mktemp("dpo-report") / "run"
    config = parse_config(DPOConfig, [
        "--config", str(ROOT / "configs" / "testbed_dpo.yaml"), "--prompts", "testbed-train:4:1", "--eval_prompts", "testbed-heldout:3:2",
        "--eval_images_per_prompt", "2", "--max_steps", "2", "--eval_every_steps", "1", "--checkpointing_steps", "2",
        "--report_to", "none", "--output-dir", str(out),
    ])
    return dpo.train(config)


def test_trainer_report_shows_scored_before_after_pairs_curves_eval_table_and_config(tiny_dpo_run):
    run = tiny_dpo_run
    text = (run / "report.html").read_text()
    before = json.loads((run / "eval_before.json").read_text())
    after = json.loads((run / "eval_after.json").read_text())
    images = _images_by_alt(text)

    # Before/after: every held-out image shown (3 prompts x 2 seeds), enlarged, with its prompt, seed and both scores.
    for i, (prompt, seed) in enumerate(zip(before["prompts"], before["seeds"])):
        for label in ("before", "after"):
            shown = images[f"{label}: {prompt} (seed {seed})"]
            assert shown.width >= 128 and shown.width % 32 == 0  # 32 px testbed images, enlarged by a whole factor
        card = text[text.index(f"(seed {seed})"):]
        card = card[: card.index('class="card"') if 'class="card"' in card else None]
        assert f"before <b>{before['scores'][i]:.3f}</b>" in card and f"after <b>{after['scores'][i]:.3f}</b>" in card
        assert html_lib.escape(prompt) in text
    first = images[f"before: {before['prompts'][0]} (seed {before['seeds'][0]})"]
    row = Image.open(run / "eval_before.png").convert("RGB")
    factor = first.width // row.height
    assert first.resize((row.height, row.height), Image.NEAREST).tobytes() == row.crop((0, 0, row.height, row.height)).tobytes()
    assert factor > 1

    # The held-out table: means, the paired difference with its standard error, images better / worse.
    b, a = np.array(before["scores"]), np.array(after["scores"])
    diff, sem = mean_and_sem(a - b)
    table = text[text.index('id="heldout-table"'):]
    table = table[: table.index("</table>")]
    by_prompt = clustered_sem(a - b, before["prompts"])  # 3 prompts x 2 seeds: clustered by prompt beside per image
    for value in (b.mean(), before["sem"], a.mean(), after["sem"], diff, sem, by_prompt):
        assert f">{value:.4f}<" in table
    assert f">{int((a > b).sum())}<" in table and f">{int((a < b).sum())}<" in table
    assert "paired change" in text

    # Curves from metrics.jsonl, the held-out curve (evals/step_1), all decodable PNG figures.
    for alt in ("loss", "implicit_acc", "reward_margin", "model_mse / ref_mse", "held-out score along the run"):
        assert images[alt].width > 200
    # The config as written (config.yaml).
    assert "beta:</span> 500" in text and "eval_prompts:</span> testbed-heldout:3:2" in text
    assert not list(run.glob(".report.html.*"))  # written atomically: no temporary file left behind


def test_trainer_report_of_a_ddpo_style_folder(tmp_path):
    """Epochs, a reward band, captioned samples with rewards; evaluations on other seeds are not paired."""
    records = [{"step": e, "reward_mean": 0.1 * e, "reward_std": 0.05, "approx_kl": 1e-4 * e} for e in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.yaml").write_text("model: testbed\napi_key: '***'\n")
    for epoch, prompt in ((1, "q"), (3, "p")):  # DDPO's samples: other prompts each epoch, each with its reward
        save_image_row(torch.rand(3, 3, 8, 8), tmp_path / "samples" / f"epoch_{epoch:05d}.png")
        captions = [{"prompt": f"{prompt}<{i}>", "reward": 0.25 * i} for i in range(3)]
        (tmp_path / "samples" / f"epoch_{epoch:05d}.json").write_text(json.dumps(captions))
    for label, seeds in (("before", [1, 2]), ("after", [3, 4])):
        (tmp_path / f"eval_{label}.json").write_text(json.dumps({"mean": 0.5, "sem": 0.1, "scores": [0.4, 0.6], "prompts": ["a", "b"], "seeds": seeds}))
    curves = (Curve("reward", ("reward_mean",)), Curve("approximate KL", ("approx_kl",)), Curve("clipped", ("clipfrac",)))
    text = write_training_report(tmp_path, "DDPO", curves=curves, step_name="epoch").read_text()
    assert "3 epochs logged" in text and "different prompts or seeds" in text
    assert "p&lt;2&gt; <b>0.500</b>" in text and "q&lt;1&gt; <b>0.250</b>" in text and "epoch 1" in text and "epoch 3" in text
    shown = _images_by_alt(text)
    assert set(shown) >= {"reward_mean", "approx_kl", "p<0>", "p<1>", "p<2>"} and "clipfrac" not in shown  # no data, no plot
    assert shown["p<1>"].size == (96, 96)
    assert "api_key:</span> ***" in text


@pytest.mark.skipif(not HAS_CHROMIUM, reason="headless Chromium is not installed (apt-get install chromium)")
def test_trainer_report_opens_in_headless_chromium(tiny_dpo_run, tmp_path):
    checker = load_script("check_report_in_browser")
    summary = checker.check_report(tiny_dpo_run / "report.html", tmp_path / "shot.png")
    assert summary["images"] >= 12 + 5 and summary["broken"] == 0


def test_small_images_are_enlarged_sharply_and_large_ones_shrunk():
    small = Image.new("RGB", (32, 32), (0, 0, 0))
    small.putpixel((0, 0), (255, 0, 0))
    big = readable(small)
    assert big.size == (160, 160)  # a whole factor (5) of 32
    assert big.getpixel((4, 4)) == (255, 0, 0) and big.getpixel((5, 5)) == (0, 0, 0)  # nearest-neighbour: no blur
    assert readable(Image.new("RGB", (512, 512))).size == (256, 256)
    assert readable(Image.new("RGB", (200, 100))).size == (200, 100)


@pytest.mark.parametrize("kl", [False, True])
def test_an_algorithms_report_draws_its_own_curves_each_once(tmp_path, kl):
    """DiffusionNFT's curves come from its registry entry: its loss once (the total loss is its own curve only when a
    KL term was added), and no other trainer's titles."""
    records = [{"step": e, "reward_mean": 0.1 * e, "policy_loss": 1.0 / e, "loss": 1.0 / e + (0.1 if kl else 0.0),
                **({"kl_to_reference": 0.1} if kl else {})} for e in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_training_report(tmp_path, "DiffusionNFT", curves=nft.ALGORITHM.curves, step_name="epoch").read_text()
    shown = _images_by_alt(text)
    assert "policy_loss" in shown and ("loss" in shown) == kl and ("kl_to_reference" in shown) == kl
