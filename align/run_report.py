"""The HTML report of a training run: held-out scores before/after, metric curves, sample images."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from align.report import Section, data_uri, img_tag, line_plot, paragraph, table_html, write_report
from align.runs import eval_step, held_out_evals, read_metrics


def _image(path: Path, alt: str) -> str:
    alt = html.escape(alt)
    return f'<p class="note">{alt}</p><img alt="{alt}" src="{data_uri(path.read_bytes())}" style="image-rendering:pixelated">'


def write_training_report(run_dir: str | Path, title: str, metric_keys: tuple[str, ...],
                          extra_sections: Sequence[Section] = ()) -> Path:
    """report.html of a run folder; ``extra_sections`` (a trainer's own results) come last."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    sections = [Section("Run", paragraph(f"Run folder: {run_dir}"))]

    before, after = run_dir / "eval_before.json", run_dir / "eval_after.json"
    if before.is_file() and after.is_file():
        results = {"before": json.loads(before.read_text()), "after": json.loads(after.read_text())}
        rows = [{"model": label, "mean score": r["mean"], "standard error": r.get("sem")} for label, r in results.items()]
        both_scored = all(r["mean"] is not None for r in results.values())
        change = results["after"]["mean"] - results["before"]["mean"] if both_scored else None
        rows.append({"model": "change", "mean score": change, "standard error": None})
        body = table_html(rows, digits=4)
        for label, r in results.items():  # align/health.py: a diverged model's images are not scored
            if r.get("degenerate"):
                body += paragraph(f"DEGENERATE: the {label} model's images were not scored: {r['degenerate']}")
        during = held_out_evals(run_dir)
        if during:  # --eval_every_steps / --eval_every_epochs: the held-out score along the run
            scored = [(eval_step(p), json.loads(p.read_text())) for p in during]
            last_step = max([r["step"] for r in records] + [step for step, _ in scored])
            points = [(0, results["before"]), *scored, (last_step, results["after"])]
            points = [(x, r) for x, r in points if r.get("mean") is not None]
            curve = ([x for x, _ in points], [r["mean"] for _, r in points], [r.get("sem") or 0.0 for _, r in points])
            body += img_tag(line_plot({"held-out score": curve}, title="held-out score (same prompts and seeds)",
                                      xlabel="step", size=(4.0, 3.0)), alt="held-out score along the run")
        for label, path in (("before", before.with_suffix(".png")), ("after", after.with_suffix(".png"))):
            if path.is_file():
                body += _image(path, f"{label}: the same prompts and seeds")
        sections.append(Section("Held-out evaluation", body))

    curves = "".join(
        img_tag(line_plot({key: ([r["step"] for r in records if key in r], [r[key] for r in records if key in r])},
                          title=key, xlabel="step", size=(4.0, 3.0)), alt=key)
        for key in metric_keys
        if any(key in r for r in records)
    )
    if curves:
        sections.append(Section("Training curves", curves))
    samples = sorted((run_dir / "samples").glob("*.png")) if (run_dir / "samples").is_dir() else []
    if samples:
        sections.append(Section("Validation samples", "".join(_image(p, p.stem) for p in samples[-4:])))
    sections.extend(extra_sections)
    return write_report(run_dir / "report.html", sections, title=title)
