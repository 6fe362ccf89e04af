"""Judge specs as typed on the command line.

    shapes-oracle                       a registered name
    shapes-oracle[noise=0.2]            name with options (values parsed as int/float/bool/str)
    openai:gpt-4.1-mini[base_url=http://127.0.0.1:8000/v1]
    pickscore:0.7,aesthetic:0.3         a weighted mix (see parse_mix)
"""

from __future__ import annotations

import re

_SPEC = re.compile(r"^\s*(?P<name>[^\[\]]+?)\s*(\[(?P<opts>.*)\])?\s*$")


def parse_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(spec: str) -> tuple[str, dict]:
    """'name[key=value,key=value]' -> ('name', {'key': value, ...})."""
    match = _SPEC.match(spec or "")
    if not match or not match.group("name"):
        raise ValueError(f"cannot parse judge spec {spec!r}; expected name or name[key=value,...]")
    options = {}
    opts = match.group("opts")
    if opts:
        for item in _split_top_level(opts):
            if "=" not in item:
                raise ValueError(f"judge option {item!r} in {spec!r} is not key=value")
            key, value = item.split("=", 1)
            options[key.strip()] = parse_value(value)
    return match.group("name").strip(), options


def parse_mix(spec: str) -> list[tuple[float, str, dict]]:
    """'a:0.7,b[x=1]:0.3' -> [(0.7, 'a', {}), (0.3, 'b', {'x': 1})]; a single name gets weight 1.

    A trailing ':<number>' is a weight; any other colon belongs to the name (openai:<model>).
    """
    parts = _split_top_level(spec)
    mix = []
    for part in parts:
        weight = 1.0
        head, _, tail = part.rpartition(":")
        if head and "]" not in tail and _is_number(tail):
            part, weight = head, float(tail)
        name, options = parse_spec(part)
        mix.append((weight, name, options))
    if not mix:
        raise ValueError("empty judge spec")
    return mix


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return [p for p in parts if p]
