"""Open a report in headless Chromium: take a screenshot and check that every image loaded.

    python scripts/check_report_in_browser.py out/eval/report.html [--screenshot shot.png]

Three checks, any failure exits 1 with the reason:
1. static: every <img src> is a data URI that decodes, or a relative path to an image file that exists;
2. browser: a copy of the page with a small script is loaded by Chromium (--dump-dom); the script
   reports images whose naturalWidth is 0 after the load event (what a user sees as a broken image);
3. screenshot: Chromium renders the page to PNG and the PNG is not blank.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import html as html_lib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

from PIL import Image, UnidentifiedImageError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MARKER_ID = "__report_image_check__"
_CHECK_SCRIPT = (
    "<script>window.addEventListener('load', function () {"
    " var imgs = Array.prototype.slice.call(document.images);"
    " var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })"
    ".map(function (i) { return i.alt || i.getAttribute('src').slice(0, 80); });"
    f" var out = document.createElement('pre'); out.id = '{MARKER_ID}';"
    " out.textContent = JSON.stringify({total: imgs.length, broken: broken});"
    " document.body.appendChild(out); });</script>"
)


class _ImageSources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.sources.append(dict(attrs).get("src") or "")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def static_problems(report: Path) -> tuple[int, list[str]]:
    """(number of images, problems) for the <img> tags of ``report``, without a browser."""
    parser = _ImageSources()
    parser.feed(report.read_text(encoding="utf-8"))
    problems = []
    for src in parser.sources:
        label = src[:60]
        try:
            if src.startswith("data:"):
                match = re.match(r"data:image/[\w.+-]+;base64,(.*)$", src, re.DOTALL)
                if not match:
                    raise ValueError("not a base64 image data URI")
                data = base64.b64decode(match.group(1), validate=True)
            elif re.match(r"^[a-z]+://", src) or src.startswith("/"):
                raise ValueError("absolute or remote image source (the report would not be self-contained)")
            else:
                path = report.parent / src
                if not path.is_file():
                    raise ValueError(f"missing file {path}")
                data = path.read_bytes()
            Image.open(io.BytesIO(data)).verify()
        except (ValueError, binascii.Error, UnidentifiedImageError, OSError) as err:
            problems.append(f"image {label!r}: {err}")
    return len(parser.sources), problems


def _run_browser(browser: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # --no-sandbox: containers often run as root, where Chromium's sandbox refuses to start.
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files"]
    with tempfile.TemporaryDirectory(prefix="report-check-profile-") as profile:
        return subprocess.run(
            [*base, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def browser_image_status(report: Path, browser: str, timeout: float = 60.0) -> dict:
    """{'total': n, 'broken': [...]} as the browser saw it after the page's load event."""
    text = report.read_text(encoding="utf-8")
    probe_html = text.replace("</body>", _CHECK_SCRIPT + "</body>") if "</body>" in text else text + _CHECK_SCRIPT
    # The probe sits beside the report so relative image paths resolve the same way.
    fd, probe_name = tempfile.mkstemp(prefix=".browser-check-", suffix=".html", dir=report.parent)
    probe = Path(probe_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(probe_html)
        result = _run_browser(browser, ["--virtual-time-budget=5000", "--dump-dom", probe.resolve().as_uri()], timeout)
    finally:
        probe.unlink(missing_ok=True)
    match = re.search(rf'<pre id="{MARKER_ID}">(.*?)</pre>', result.stdout, re.DOTALL)
    if not match:
        raise RuntimeError(
            f"the browser did not run the image check (exit {result.returncode}); stderr: {result.stderr[-500:]}"
        )

    return json.loads(html_lib.unescape(match.group(1)))


def take_screenshot(report: Path, browser: str, out: Path, width: int = 1280, height: int = 1600, timeout: float = 60.0) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = _run_browser(
        browser,
        [f"--screenshot={out.resolve()}", f"--window-size={width},{height}", "--virtual-time-budget=5000", report.resolve().as_uri()],
        timeout,
    )
    if not out.is_file():
        raise RuntimeError(f"the browser wrote no screenshot (exit {result.returncode}); stderr: {result.stderr[-500:]}")
    return out


def screenshot_is_blank(path: Path) -> bool:
    """True when every pixel has the same colour (nothing rendered)."""
    with Image.open(path) as img:
        extrema = img.convert("RGB").getextrema()
    return all(low == high for low, high in extrema)


def check_report(report: Path, screenshot: Path | None = None, browser: str | None = None) -> dict:
    """Run all three checks; returns a summary dict, raises RuntimeError with every problem found."""
    report = Path(report)
    if not report.is_file():
        raise RuntimeError(f"report not found: {report}")
    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError(f"no Chromium found (looked for {', '.join(BROWSERS)}); install it, e.g. apt-get install chromium")
    total, problems = static_problems(report)
    status = browser_image_status(report, browser)
    if status["total"] != total:
        problems.append(f"the browser saw {status['total']} images, the HTML has {total}")
    problems += [f"broken in the browser: {name}" for name in status["broken"]]
    shot = take_screenshot(report, browser, screenshot or report.with_name(report.stem + "_screenshot.png"))
    if screenshot_is_blank(shot):
        problems.append(f"the screenshot {shot} is blank")
    if problems:
        raise RuntimeError("; ".join(problems))
    return {"report": str(report), "images": total, "broken": 0, "screenshot": str(shot)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="path of the report.html to check")
    parser.add_argument("--screenshot", type=Path, default=None, help="where to write the PNG (default: beside the report)")
    parser.add_argument("--browser", default=None, help="browser executable (default: the first Chromium on PATH)")
    args = parser.parse_args(argv)
    try:
        summary = check_report(args.report, args.screenshot, args.browser)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
