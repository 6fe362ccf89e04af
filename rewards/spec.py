"""Judge specs as typed on the command line.

    shapes-oracle                       a registered name
    shapes-oracle[noise=0.2]            name with options (values parsed as int/float/bool/str)
    openai:gpt-4.1-mini[base_url=http://127.0.0.1:8000/v1]
    pickscore:0.7,aesthetic:0.3         a weighted mix (see parse_judges)

A judge string is parsed once into ``JudgeSpec`` objects (name, options, weight); the commands check, price,
load and mix judges from those, never from the string again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    """'name[key=value,key=value]' -> ('name', {'key': value, ...}): the bracket syntax judges and prompt sets share."""
    match = _SPEC.match(spec or "")
    if not match or not match.group("name"):
        raise ValueError(f"cannot parse judge spec {spec!r}; expected name or name[key=value,...]")
    options = {}
    opts = match.group("opts")
    if opts:
        for item in split_top_level(opts):
            if "=" not in item:
                raise ValueError(f"judge option {item!r} in {spec!r} is not key=value")
            key, value = item.split("=", 1)
            options[key.strip()] = parse_value(value)
    return match.group("name").strip(), options


@dataclass(frozen=True)
class JudgeSpec:
    """One judge as the user named it: ``name[key=value,...]`` with its weight in a mix (1 alone)."""

    name: str
    options: dict = field(default_factory=dict)
    weight: float = 1.0

    def __str__(self) -> str:
        options = ",".join(f"{key}={value}" for key, value in self.options.items())
        return self.name + (f"[{options}]" if options else "")


def parse_judges(text: str) -> list[JudgeSpec]:
    """'a:0.7,b[x=1]:0.3' -> [JudgeSpec('a', {}, 0.7), JudgeSpec('b', {'x': 1}, 0.3)]; a single name gets weight 1.

    A trailing ':<number>' is a weight; any other colon belongs to the name (openai:<model>).
    """
    specs = []
    for part in split_top_level(text or ""):
        weight = 1.0
        head, _, tail = part.rpartition(":")
        if head and "]" not in tail and _is_number(tail):
            part, weight = head, float(tail)
        name, options = parse_spec(part)
        specs.append(JudgeSpec(name, options, weight))
    if not specs:
        raise ValueError("empty judge spec")
    return specs


def parse_judge(text: str | JudgeSpec) -> JudgeSpec:
    """One judge (a spec already parsed passes through); a weighted mix is refused."""
    if isinstance(text, JudgeSpec):
        return text
    specs = parse_judges(text)
    if len(specs) > 1 or specs[0].weight != 1.0:
        raise ValueError(f"{text!r} is a weighted mix of judges; one judge is needed here (mixes are for DDPO's --reward)")
    return specs[0]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_top_level(text: str) -> list[str]:
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
