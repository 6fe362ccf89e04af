"""Report helpers: embedded images, tables, plots; the page opens in headless Chromium."""

import base64
import io
import re
import shutil

import pytest
import torch
from PIL import Image
from script_loader import load_script

from align import report


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
