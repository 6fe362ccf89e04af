"""Edit prompts: an instruction and its source image in one string, so that every place a prompt goes (prompt sets,
rollouts, preference pairs, judges, caches, reports) carries both unchanged.

    [source: photos/cat.png] make the cat wear a red hat        a source image file (a path as the run sees it)
    [source: shapes:red circle 0,1] make the red circle blue    a scene of the shapes editing world, drawn exactly

``load_source`` gives the source as an RGB PIL image, for the model families that condition on it and for the
judges that look at it. A prompt without the ``[source: ...]`` prefix is an ordinary text-to-image prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from rewards.shapes_edit import SCENE_SCHEME, render_scene

_EDIT_RE = re.compile(r"^\[source: (?P<source>[^\]]+)\] ?(?P<instruction>.*)$", re.DOTALL)


@dataclass(frozen=True)
class EditPrompt:
    source: str  # a file path or a shapes: scene spec
    instruction: str

    def text(self) -> str:
        return edit_prompt(self.source, self.instruction)


def edit_prompt(source: str, instruction: str) -> str:
    if "]" in source:
        raise ValueError(f"a source reference cannot hold ']': {source!r}")
    return f"[source: {source}] {instruction}".rstrip()


def parse_edit_prompt(text: str) -> EditPrompt | None:
    """The source and instruction of an edit prompt; None for an ordinary prompt."""
    match = _EDIT_RE.match(text)
    return EditPrompt(match.group("source").strip(), match.group("instruction").strip()) if match else None


def is_edit_prompt(text: str) -> bool:
    return parse_edit_prompt(text) is not None


def require_edit_prompt(text: str, who: str) -> EditPrompt:
    """The edit prompt ``text``, else one ValueError saying what ``who`` (a judge, a model family) needs."""
    parsed = parse_edit_prompt(text)
    if parsed is None:
        raise ValueError(f"{who} needs edit prompts '[source: <image file or shapes: scene>] <instruction>', "
                         f"got {text[:60]!r}")
    return parsed


def without_instruction(text: str) -> str:
    """The unconditional side of an edit prompt (caption dropout, guidance): the source kept, the instruction empty."""
    parsed = parse_edit_prompt(text)
    return "" if parsed is None else edit_prompt(parsed.source, "")


def load_source(source: str, size: int | None = None) -> Image.Image:
    """The source image of a reference, RGB; ``size``: resized (bicubic) to a square of that side where it differs
    (a ``shapes:`` scene is drawn at that size)."""
    if source.startswith(SCENE_SCHEME):
        return render_scene(source, size or 32)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"edit source {source!r} is not an image file (nor a {SCENE_SCHEME} scene)")
    image = Image.open(path).convert("RGB")
    if size is not None and image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    return image
