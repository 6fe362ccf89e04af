"""Text typed by a user (a flag's value, a prompt, a path) checked and shown safely, for both packages (``rewards``
never imports ``align``; ``align.declared`` uses these for every option).

- ``text_problem``: why a value is refused: bytes that were not UTF-8 (Python hands them over as surrogate escapes),
  a control character (NUL, an ANSI escape, a line break), a bidirectional override (the "Trojan Source" characters,
  which show text in another order than it is read);
- ``escaped`` / ``shown``: a value as a one-line message prints it, those characters written as escapes.
"""

from __future__ import annotations

import unicodedata

BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")
SHOWN_LENGTH = 120  # a value is shown in a message up to this many characters


def escaped(text: str) -> str:
    """``text`` with control characters (line breaks too), bidirectional overrides and bytes that were not UTF-8
    written as escapes: printed, it stays one line and cannot restyle or reorder the terminal."""
    out = []
    for char in str(text):
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (Python's surrogateescape of argv)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char.isprintable() and char not in BIDI_CONTROLS:
            out.append(char)
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)


def shown(value) -> str:
    """A value as a message quotes it: escaped, and cut short."""
    text = str(value)
    return f"'{escaped(text[:SHOWN_LENGTH])}{'…' if len(text) > SHOWN_LENGTH else ''}'"


def text_problem(value: str) -> str | None:
    """Why a text value is refused (bytes that were not UTF-8, a control character, a bidirectional override), or
    None."""
    for position, char in enumerate(value):
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:
            return f"is not UTF-8 text (byte {escaped(char)} at character {position})"
        if char in BIDI_CONTROLS:
            return (f"holds a bidirectional override (U+{code:04X} at character {position}), which shows the text in "
                    "another order than it is read")
        if unicodedata.category(char) == "Cc":
            return f"holds a control character ({escaped(char)} at character {position})"
    return None
