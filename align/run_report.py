"""The HTML report of a training run: metric curves, before/after scores, sample images."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from align.runs import atomic_write_text


def _png_data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def plot_metrics(records: list[dict], keys: tuple[str, ...]) -> bytes | None:
    """One small line plot per metric key found in the records; PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(3.6 * len(present), 2.8), squeeze=False)
    for ax, key in zip(axes[0], present):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def write_training_report(run_dir: str | Path, title: str, metric_keys: tuple[str, ...]) -> Path:
    run_dir = Path(run_dir)
    records = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    parts = [f"<h1>{html.escape(title)}</h1>", f"<p>Run folder: <code>{html.escape(str(run_dir))}</code></p>"]

    before, after = run_dir / "eval_before.json", run_dir / "eval_after.json"
    if before.is_file() and after.is_file():
        b, a = json.loads(before.read_text())["mean"], json.loads(after.read_text())["mean"]
        parts.append(
            "<h2>Held-out evaluation</h2><table><tr><th></th><th>mean score</th></tr>"
            f"<tr><td>before</td><td>{b:.4f}</td></tr><tr><td>after</td><td>{a:.4f}</td></tr>"
            f"<tr><td>change</td><td>{a - b:+.4f}</td></tr></table>"
        )
        for label, path in (("before", before.with_suffix(".png")), ("after", after.with_suffix(".png"))):
            if path.is_file():
                parts.append(f"<p>{label}</p><img alt='{label}' src='{_png_data_uri(path.read_bytes())}'>")

    curves = plot_metrics(records, metric_keys)
    if curves:
        parts.append(f"<h2>Training curves</h2><img alt='curves' src='{_png_data_uri(curves)}'>")
    samples = sorted((run_dir / "samples").glob("*.png")) if (run_dir / "samples").is_dir() else []
    if samples:
        parts.append("<h2>Validation samples</h2>")
        for path in samples[-4:]:
            parts.append(f"<p>{html.escape(path.stem)}</p><img alt='{html.escape(path.stem)}' src='{_png_data_uri(path.read_bytes())}'>")
    style = "body{font-family:sans-serif;margin:2em} img{image-rendering:pixelated;max-width:100%} td,th{padding:4px 10px;border:1px solid #ccc}"
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{''.join(parts)}</body></html>"
    target = run_dir / "report.html"
    atomic_write_text(target, page)
    return target
