"""Self-contained HTML reports: tables, matplotlib plots and image grids, all embedded as data URIs.

General helpers shared by evaluate, best-of-N, judgebench and the trainers:

    section = Section("Ranks", table_html(rows))
    section = Section("Reward vs N", img_tag(line_plot({"oracle": (xs, ys)}, xlabel="N")))
    write_report("out/report.html", [section, ...], title="My run")

A report is one file: it can be moved, mailed or opened from any folder with no broken images.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from align.run_folder import atomic_write_text
from rewards.images import to_pil

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
table.grid td { text-align: center; vertical-align: top; font-size: 0.8em; }
table.grid img { image-rendering: pixelated; display: block; margin: auto; }
p.note { color: #555; font-size: 0.9em; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { border: 1px solid #ddd; border-radius: 4px; padding: 6px; width: 348px; font-size: 0.85em; }
.card .prompt { min-height: 2.6em; margin-bottom: 4px; }
.card .pair { display: flex; gap: 8px; justify-content: center; }
.card figure { margin: 0; text-align: center; }
.card img, table.strip img { image-rendering: pixelated; display: block; margin: auto; }
.up { color: #1a7f37; font-weight: bold; } .down { color: #c62828; font-weight: bold; } .quiet { color: #777; }
.plots { display: flex; flex-wrap: wrap; gap: 8px; }
table.strip th { font-size: 0.75em; max-width: 110px; text-align: center; } table.strip td { text-align: center; vertical-align: top; font-size: 0.75em; max-width: 110px; }
div.config { columns: 3; column-gap: 2em; font-size: 0.85em; } div.config div { break-inside: avoid; overflow-wrap: anywhere; }
"""


@dataclass
class Section:
    """One heading and its HTML body (already escaped/built by the helpers below)."""

    title: str
    body: str


# ------------------------------------------------------------------------------------ images


def png_bytes(image) -> bytes:
    """PNG bytes of a PIL image or a [3, H, W] / [1, 3, H, W] tensor in [0, 1]."""
    if isinstance(image, torch.Tensor):
        image = to_pil(image if image.ndim == 4 else image.unsqueeze(0))[0]
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image or an image tensor, got {type(image).__name__}")
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_uri(png: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(png).decode('ascii')}"


def img_tag(image, width: int | None = None, alt: str = "", title: str | None = None) -> str:
    """An <img> with the image embedded; ``image`` may be PNG bytes, a PIL image or a tensor."""
    png = image if isinstance(image, bytes) else png_bytes(image)
    attrs = f' width="{int(width)}"' if width else ""
    if title:
        attrs += f' title="{html.escape(title)}"'
    return f'<img src="{data_uri(png)}" alt="{html.escape(alt)}"{attrs}>'


def image_grid(images, ncols: int, pad: int = 2, background: tuple = (255, 255, 255)) -> Image.Image:
    """One PIL image tiling ``images`` (PIL list or [N, 3, H, W] tensor) row by row."""
    pils = to_pil(images)
    if not pils:
        raise ValueError("image_grid needs at least one image")
    ncols = max(1, min(ncols, len(pils)))
    nrows = math.ceil(len(pils) / ncols)
    w = max(p.width for p in pils)
    h = max(p.height for p in pils)
    grid = Image.new("RGB", (ncols * (w + pad) + pad, nrows * (h + pad) + pad), background)
    for i, img in enumerate(pils):
        r, c = divmod(i, ncols)
        grid.paste(img, (pad + c * (w + pad), pad + r * (h + pad)))
    return grid


def image_grid_html(
    cells: Sequence[Sequence],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    width: int = 96,
    corner: str = "",
) -> str:
    """An HTML table of images: ``cells[r][c]`` (PIL / tensor / PNG bytes / None) under labelled rows and columns."""
    if len(cells) != len(row_labels):
        raise ValueError(f"image grid: {len(cells)} rows of images but {len(row_labels)} row labels")
    head = f'<th class="text">{html.escape(corner)}</th>' + "".join(
        f'<th class="text">{html.escape(str(c))}</th>' for c in col_labels
    )
    rows = []
    for label, row in zip(row_labels, cells):
        if len(row) != len(col_labels):
            raise ValueError(f"image grid: row {label!r} has {len(row)} images for {len(col_labels)} columns")
        tds = "".join(
            f"<td>{img_tag(img, width=width, alt=f'{label} / {col}') if img is not None else '-'}</td>"
            for img, col in zip(row, col_labels)
        )
        rows.append(f'<tr><td class="text">{html.escape(str(label))}</td>{tds}</tr>')
    return f'<table class="grid"><tr>{head}</tr>{"".join(rows)}</table>'


# ------------------------------------------------------------------------------------- plots


def figure_png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    series: dict,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    size: tuple[float, float] = (6.0, 4.0),
) -> bytes:
    """PNG of one line per series: ``{name: (xs, ys)}`` or ``{name: (xs, ys, errors)}`` (error bars)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    for name, values in series.items():
        xs, ys = np.asarray(values[0], dtype=float), np.asarray(values[1], dtype=float)
        errors = values[2] if len(values) > 2 else None
        if errors is not None:
            ax.errorbar(xs, ys, yerr=np.asarray(errors, dtype=float), marker="o", capsize=3, label=str(name))
        else:
            ax.plot(xs, ys, marker="o", label=str(name))
    if logx:
        ax.set_xscale("log", base=2)
    elif all(float(x).is_integer() for values in series.values() for x in values[0]):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and epochs: no 2.5 ticks
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return figure_png(fig)


def bar_plot(
    labels: Sequence[str],
    values: Sequence[float],
    errors=None,
    title: str = "",
    ylabel: str = "",
    reference_line: float | None = None,
    size: tuple[float, float] = (6.0, 3.5),
) -> bytes:
    """PNG bar chart; ``errors`` is symmetric [n] or asymmetric [2, n] (lower, upper distances)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    x = np.arange(len(labels))
    yerr = None if errors is None else np.asarray(errors, dtype=float)
    ax.bar(x, np.asarray(values, dtype=float), yerr=yerr, capsize=4, color="#4c78a8")
    if reference_line is not None:
        ax.axhline(reference_line, color="#888", linestyle="--", linewidth=1)
    ax.set_xticks(x)
    ax.set_xticklabels([str(label) for label in labels], rotation=20, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    return figure_png(fig)


def scatter_plot(
    xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], title: str = "", xlabel: str = "", ylabel: str = ""
) -> bytes:
    """PNG scatter with a text label beside each point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.scatter(xs, ys, color="#e45756")
    for x, y, label in zip(xs, ys, labels):
        ax.annotate(str(label), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return figure_png(fig)


# ------------------------------------------------------------------------------------- tables


def format_value(value, digits: int = 3) -> str:
    """How numbers appear in report tables (tests compare tables with results files through this)."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return "-" if math.isnan(value) else f"{float(value):.{digits}f}"
    return str(value)


def table_html(rows: Sequence[dict], columns: Sequence[str] | None = None, digits: int = 3, table_id: str | None = None) -> str:
    """An HTML table from a list of dicts (columns default to the keys of the first row, in order)."""
    if not rows:
        return '<p class="note">(no rows)</p>'
    columns = list(columns or rows[0].keys())

    def cell(tag, value):
        text = format_value(value, digits)
        cls = ' class="text"' if not isinstance(value, (int, float, np.number)) or isinstance(value, bool) else ""
        return f"<{tag}{cls}>{html.escape(text)}</{tag}>"

    head = "".join(f'<th class="text">{html.escape(str(c))}</th>' for c in columns)
    body = "".join("<tr>" + "".join(cell("td", row.get(c)) for c in columns) + "</tr>" for row in rows)
    ident = f' id="{html.escape(table_id)}"' if table_id else ""
    return f"<table{ident}><tr>{head}</tr>{body}</table>"


def paragraph(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


# ------------------------------------------------------------------------------------- report


def render_report(sections: Sequence[Section], title: str = "Report") -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>\n{section.body}")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(path: str | Path, sections: Sequence[Section], title: str = "Report") -> Path:
    """Write the HTML page atomically and return its path."""
    path = Path(path)
    atomic_write_text(path, render_report(sections, title))
    return path
