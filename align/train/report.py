"""The HTML report of a training run (DPO, DDPO): what changed, shown so that it can be read.

    write_training_report(run_dir, "Diffusion-DPO: testbed", curves=(Curve("DPO loss", ("loss",)),))

Sections, from what the run folder holds (each one is left out when its files are absent):
1. held-out evaluation: mean score before/after, the paired difference and its standard error (per image and
   clustered by prompt; for the testbed's captions also by part of the caption split), how many images got better
   or worse (eval_before.json / eval_after.json), and the score along the run (evals/); with a second held-out
   judge, both judges' gains along the run and against the distance from the base model;
2. before/after: the same held-out prompts and seeds, side by side, with each image's score;
3. training curves from metrics.jsonl, as the trainer (for online RL, the algorithm) names them;
4. samples saved during training (samples/), with their prompts (and rewards) where they were recorded;
5. the run's config (config.yaml, secrets already masked).
Small images (the testbed's 32-64 px) are enlarged with nearest-neighbour so their pixels stay sharp.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from align.eval.paired import changes_by_part
from align.eval.report import (
    Section,
    figure_png,
    img_tag,
    line_plot,
    paragraph,
    pyplot,
    table_html,
    write_report,
)
from align.metrics import clustered_sem, mean_and_sem
from align.run_folder import CONFIG_FILE, eval_step, held_out_evals, read_metrics

SHOWN_SIZE = 160  # px: small images are enlarged (by a whole factor) to about this size
MAX_SIZE = 256  # px: large images (SD's 512) are shrunk to this, so the page stays a few MB
MAX_PAIRS = 24  # before/after pairs shown
SAME = 1e-9  # score changes smaller than this count as "same"


@dataclass(frozen=True)
class Curve:
    """One training-curve plot: its title and the metrics.jsonl keys drawn on it; with ``when_logged``, only if one
    of those keys was logged too (a total loss is its own curve only where a KL term was added to the policy loss)."""

    title: str
    keys: tuple[str, ...]
    when_logged: tuple[str, ...] = ()



# ------------------------------------------------------------------------------------ images


def readable(image: Image.Image, target: int = SHOWN_SIZE, largest: int = MAX_SIZE) -> Image.Image:
    """A small image enlarged by a whole factor with nearest-neighbour (to about ``target`` px), a large one shrunk."""
    side = max(image.size)
    if side > largest:
        scale = largest / side
        return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.LANCZOS)
    factor = max(1, target // side)
    return image.resize((image.width * factor, image.height * factor), Image.NEAREST) if factor > 1 else image


def split_row(path: Path, count: int | None = None) -> list[Image.Image]:
    """The images of a row written by align.train.heldout.save_image_row (``count`` tiles; square tiles if unknown)."""
    with Image.open(path) as row:
        row = row.convert("RGB")
    count = count or max(1, row.width // row.height)
    width = row.width // count
    return [row.crop((i * width, 0, (i + 1) * width, row.height)) for i in range(count)]


# ------------------------------------------------------------------------------------ held-out evaluation


def paired_summary(before: dict, after: dict) -> dict:
    """Mean before/after, their paired difference (same prompts and seeds) with its standard error, and counts."""
    b, a = np.asarray(before["scores"], dtype=float), np.asarray(after["scores"], dtype=float)
    summary = {"images": int(b.size), "mean before": float(b.mean()), "mean after": float(a.mean())}
    paired = b.size == a.size and before.get("prompts") == after.get("prompts") and before.get("seeds") == after.get("seeds")
    if paired:
        diff, diff_sem = mean_and_sem(a - b)
        summary |= {
            "difference": diff,
            "standard error": diff_sem,
            "standard error by prompt": clustered_sem(a - b, before["prompts"]),
            "prompts": len(set(before["prompts"])),
            "better": int(((a - b) > SAME).sum()),
            "worse": int(((b - a) > SAME).sum()),
            "same": int((np.abs(a - b) <= SAME).sum()),
        }
    summary["paired"] = paired
    return summary


def headline(summary: dict, judge: str) -> str:
    """One sentence: the held-out score before and after, and the paired change."""
    text = f"Held-out {judge} score: {summary['mean before']:.4f} before, {summary['mean after']:.4f} after training"
    if summary["paired"]:
        text += (f"; paired change {summary['difference']:+.4f} (standard error {summary['standard error']:.4f} per image, "
                 f"{summary['standard error by prompt']:.4f} clustered by prompt over {summary['prompts']} prompts); "
                 f"{summary['better']} of {summary['images']} images better, {summary['worse']} worse")
    return text + "."


def _eval_table(before: dict, after: dict, summary: dict) -> str:
    rows = [
        {"": "before training", "mean score": summary["mean before"], "standard error": before.get("sem")},
        {"": "after training", "mean score": summary["mean after"], "standard error": after.get("sem")},
    ]
    if summary["paired"]:
        rows.append({"": "after - before (paired)", "mean score": summary["difference"], "standard error": summary["standard error"],
                     "by prompt": summary["standard error by prompt"],
                     "images better": summary["better"], "images worse": summary["worse"], "unchanged": summary["same"]})
        parts = changes_by_part(before["scores"], after["scores"], before["prompts"])
        if len(parts) > 1:  # testbed captions of several parts of the split: each part's change on its own
            rows += [{"": f"after - before, {label}", "mean score": c.mean, "standard error": c.sem_images,
                      "by prompt": c.sem_prompts, "images better": c.better, "images worse": c.worse,
                      "unchanged": c.images - c.better - c.worse} for label, c in parts.items()]
        note = (f"{summary['images']} held-out images (prompt x seed), each drawn once by the starting model and once by the "
                "trained one: the change is the mean of the paired differences, with the standard error of that mean per "
                "image and clustered by prompt (a prompt's seeds share its difficulty, so this one is the gain's "
                "standard error when prompts are a sample).")
    else:
        note = "The before and after evaluations used different prompts or seeds: only their means are comparable."
    columns = ["", "mean score", "standard error", "by prompt", "images better", "images worse", "unchanged"]
    return table_html(rows, columns=columns, digits=4, table_id="heldout-table") + paragraph(note)


def _heldout_curve(run_dir: Path, before: dict, after: dict, last_step: int, step_name: str) -> str:
    during = held_out_evals(run_dir)
    if not during:
        return ""
    points = [(0, before), *[(eval_step(p), json.loads(p.read_text())) for p in during], (last_step, after)]
    points = [(x, r) for x, r in points if r.get("mean") is not None]
    curve = ([x for x, _ in points], [r["mean"] for _, r in points], [r.get("sem") or 0.0 for _, r in points])
    plot = line_plot({"held-out score": curve}, title="held-out score", xlabel=step_name,
                     ylabel="mean ± standard error", size=(4.0, 2.8))
    return img_tag(plot, alt="held-out score along the run")


def judge_gains(before: dict, evaluations: list[tuple[int, dict]]) -> dict[str, tuple[list, list, list, list]]:
    """Each judge's paired gain along the run, in units of that judge's std over the starting model's images (so a
    learned judge and the exact oracle fit one plot): {judge: (steps, gains, standard errors, prediction changes)}.
    Only evaluations on the same prompts and seeds as ``before`` count."""
    judges = {"judge": lambda r: r.get("scores")}
    if before.get("second_judge"):
        judges[before["second_judge"]["name"]] = lambda r: (r.get("second_judge") or {}).get("scores")
    curves = {}
    for name, scores_of in judges.items():
        base = np.asarray(scores_of(before), dtype=float)
        spread = float(base.std()) or 1.0
        points = []
        for step, record in evaluations:
            scores = scores_of(record)
            if scores is None or len(scores) != base.size or record.get("seeds") != before.get("seeds"):
                continue
            gain, sem = mean_and_sem((np.asarray(scores, dtype=float) - base) / spread)
            points.append((step, gain, sem, record.get("prediction_change")))
        curves[name] = tuple(list(column) for column in zip(*points)) if points else ([], [], [], [])
    return curves


def _over_optimisation(run_dir: Path, before: dict, after: dict, last_step: int, step_name: str, judge: str) -> str:
    """With a second held-out judge: both judges' gains along the run, against the steps and against the distance
    from the base model (the over-optimisation curve), as a plot and a table."""
    if not before.get("second_judge"):
        return ""
    during = [(eval_step(path), json.loads(path.read_text())) for path in held_out_evals(run_dir)]
    curves = judge_gains(before, [(0, before), *during, (last_step, after)])
    names = {key: (judge if key == "judge" else key) for key in curves}
    plots = [line_plot({names[k]: (c[0], c[1], c[2]) for k, c in curves.items()}, title="held-out gain of each judge",
                       xlabel=step_name, ylabel="paired gain / the base model's std", size=(4.0, 2.8))]
    if all(c[3] and None not in c[3] for c in curves.values()):
        plots.append(line_plot({names[k]: (c[3], c[1], c[2]) for k, c in curves.items()},
                               title="gain against the distance from the base model",
                               xlabel="mean squared change of the prediction", ylabel="gain / std", size=(4.0, 2.8)))
    rows = []
    for label, record in (("before", before), ("after", after)):
        second = record.get("second_judge") or {}
        rows.append({"": label, judge: record.get("mean"), second.get("name", "second judge"): second.get("mean"),
                     "prediction change": record.get("prediction_change")})
    columns = ["", judge, before["second_judge"]["name"], "prediction change"]
    note = paragraph("The same held-out images scored by the run's judge and by a second judge (with a learned judge as "
                     "the reward, the exact oracle): where the judge's gain keeps rising and the second judge's stops, "
                     "the run optimises the judge's errors. Gains are paired (the same prompts and seeds as before "
                     "training), in units of each judge's standard deviation over the starting model's images.")
    images = "".join(img_tag(plot, alt="held-out gains of both judges") for plot in plots)
    return note + table_html(rows, columns=columns, digits=4, table_id="second-judge-table") + f'<div class="plots">{images}</div>'


def _score_class(delta: float) -> str:
    return "up" if delta > SAME else "down" if delta < -SAME else "quiet"


def _before_after_cards(run_dir: Path, before: dict, after: dict) -> str:
    """One card per held-out (prompt, seed): the image before and after training with its score."""
    rows = {}
    for label, result in (("before", before), ("after", after)):
        png = run_dir / f"eval_{label}.png"
        if not png.is_file():
            return ""
        rows[label] = split_row(png, result.get("row_images"))
    count = min(len(rows["before"]), len(rows["after"]), len(before["scores"]), len(after["scores"]), MAX_PAIRS)
    cards = []
    for i in range(count):
        prompt, seed = before["prompts"][i], before["seeds"][i]
        b, a = before["scores"][i], after["scores"][i]
        figures = "".join(
            f"<figure>{img_tag(readable(rows[label][i]), alt=f'{label}: {prompt} (seed {seed})')}"
            f"<figcaption>{label} <b>{score:.3f}</b></figcaption></figure>"
            for label, score in (("before", b), ("after", a))
        )
        cards.append(
            f'<div class="card"><div class="prompt">{html.escape(prompt)} <span class="quiet">(seed {seed})</span></div>'
            f'<div class="pair">{figures}</div>'
            f'<div>change: <span class="{_score_class(a - b)}">{a - b:+.3f}</span></div></div>'
        )
    note = paragraph(f"The first {count} of {len(before['scores'])} held-out images, in evaluation order; the score is the "
                     "evaluation judge's.")
    return note + f'<div class="cards">{"".join(cards)}</div>'


# ------------------------------------------------------------------------------------ curves and samples

_NAMES = {"model_mse": "trained model", "ref_mse": "reference"}  # legend names


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [x for x, _ in points], [y for _, y in points]


def _curves(records: list[dict], curves: Sequence[Curve], step_name: str) -> str:
    plots = []
    for curve in curves:
        if curve.when_logged and not any(key in r for r in records for key in curve.when_logged):
            continue
        series = {_NAMES.get(key, key): _series(records, key) for key in curve.keys}
        series = {name: points for name, points in series.items() if points[0]}
        if not series:
            continue
        if curve.keys == ("reward_mean",) and any("reward_std" in r for r in records):
            plot = _reward_band_plot(records, curve.title, step_name)
        else:
            plot = line_plot(series, title=curve.title, xlabel=step_name, size=(4.0, 2.8))
        plots.append(img_tag(plot, alt=" / ".join(curve.keys)))
    return f'<div class="plots">{"".join(plots)}</div>' if plots else ""


def _reward_band_plot(records: list[dict], title: str, step_name: str) -> bytes:
    """The epoch's mean reward with a band of ± its standard deviation over the epoch's samples."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.0, 2.8))
    rows = [r for r in records if "reward_mean" in r and "reward_std" in r]
    xs = np.array([r["step"] for r in rows], dtype=float)
    mean = np.array([r["reward_mean"] for r in rows], dtype=float)
    std = np.array([r["reward_std"] for r in rows], dtype=float)
    ax.fill_between(xs, mean - std, mean + std, alpha=0.2, label="± std within the epoch")
    ax.plot(xs, mean, marker="o", markersize=3, label="mean")
    ax.set_title(title)
    ax.set_xlabel(step_name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure_png(fig)


def _samples(run_dir: Path, limit: int = 8) -> str:
    """Rows saved during training (samples/*.png): the first, the last and two between, with their prompts
    (once, as column heads, when every row drew the same prompts: the trainers' validation images) and rewards."""
    folder = run_dir / "samples"
    rows = sorted(folder.glob("*.png")) if folder.is_dir() else []
    if not rows:
        return ""
    if len(rows) > 4:
        rows = [rows[0], *rows[1:-1][-2:], rows[-1]]
    captions = {}
    for path in rows:
        captions_file = path.with_suffix(".json")
        captions[path] = json.loads(captions_file.read_text()) if captions_file.is_file() else []
    prompts = [[str(c.get("prompt", "")) for c in captions[path][:limit]] for path in rows]
    shared = prompts[0] if prompts[0] and all(p == prompts[0] for p in prompts) else None
    head = "<tr><th></th>" + "".join(f"<th>{html.escape(p)}</th>" for p in shared) + "</tr>" if shared else ""
    html_rows = []
    for path, row_prompts in zip(rows, prompts):
        entries = captions[path]
        images = split_row(path, len(entries) or None)[:limit]
        cells = []
        for i, image in enumerate(images):
            entry = entries[i] if i < len(entries) else {}
            text = "" if shared else html.escape(row_prompts[i] if i < len(row_prompts) else "")
            if "reward" in entry:
                text += f" <b>{entry['reward']:.3f}</b>"
            alt = entry.get("prompt", f"{path.stem} {i}")
            cells.append(f"<td>{img_tag(readable(image, target=96), alt=alt)}{text}</td>")
        kind, number = path.stem.rsplit("_", 1)
        html_rows.append(f'<tr><th class="text">{kind} {int(number)}</th>{"".join(cells)}</tr>')
    return f'<table class="strip">{head}{"".join(html_rows)}</table>'


def _config_list(run_dir: Path) -> str:
    """config.yaml as a compact list in columns (secrets were masked when it was written)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return ""
    config = yaml.safe_load(path.read_text()) or {}
    entries = "".join(
        f'<div><span class="quiet">{html.escape(str(key))}:</span> {html.escape("-" if value is None else str(value))}</div>'
        for key, value in config.items()
    )
    return f'<div class="config" id="config">{entries}</div>'


# ------------------------------------------------------------------------------------ the page


def write_training_report(run_dir: str | Path, title: str, curves: Sequence[Curve],
                          extra_sections: Sequence[Section] = (), judge: str | None = None, step_name: str = "step") -> Path:
    """report.html of a run folder. ``curves``: the training-curve plots; ``judge``: the held-out evaluation's judge
    (named in the table); ``step_name``: what metrics.jsonl's "step" counts (DDPO: epochs); ``extra_sections`` come
    last."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    last_step = max((r["step"] for r in records), default=0)
    lede = f"Run folder {run_dir}: {last_step} {step_name}s logged."
    sections = []

    before_file, after_file = run_dir / "eval_before.json", run_dir / "eval_after.json"
    if before_file.is_file() and after_file.is_file():
        before, after = json.loads(before_file.read_text()), json.loads(after_file.read_text())
        # align/health.py: a diverged model's images are marked degenerate and not scored
        degenerate = [(label, r["degenerate"]) for label, r in (("before", before), ("after", after)) if r.get("degenerate")]
        if degenerate:
            lede += " " + " ".join(f"The {label} model's images were degenerate ({why}) and not scored." for label, why in degenerate)
            body = "".join(paragraph(f"DEGENERATE: the {label} model's images were not scored: {why}") for label, why in degenerate)
        else:
            summary = paired_summary(before, after)
            lede += " " + headline(summary, judge or "judge")
            body = _eval_table(before, after, summary) + _heldout_curve(run_dir, before, after, last_step, step_name)
            body += _over_optimisation(run_dir, before, after, last_step, step_name, judge or "judge")
        sections.append(Section("Held-out evaluation", body))
        cards = "" if degenerate else _before_after_cards(run_dir, before, after)
        if cards:
            sections.append(Section("Before and after training: the same prompts and seeds", cards))

    sections.insert(0, Section("Summary", f'<p>{html.escape(lede)}</p>'))
    plots = _curves(records, curves, step_name)
    if plots:
        sections.append(Section("Training curves", plots))
    samples = _samples(run_dir)
    if samples:
        sections.append(Section("Samples during training", samples))
    config = _config_list(run_dir)
    if config:
        sections.append(Section("Config", paragraph("config.yaml of the run (secrets masked).") + config))
    sections.extend(extra_sections)
    return write_report(run_dir / "report.html", sections, title=title)
