"""A persistent SQLite cache of judge answers.

Key: judge id, template version (inside the question key), the full prompt text, the hashes of
the images in the order they were sent, and the decoding settings. Value: the raw answer text plus
token counts, so parsing can be redone later without new calls. Each answer is committed as soon as
it arrives, so a crash loses nothing already paid for and a rerun repeats no call.

Only real answers are stored (including refusals and unparseable text); failed calls (network
errors, exhausted retries) are not, so a rerun tries them again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from rewards.secrets import scrub_text

_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    key TEXT PRIMARY KEY,
    judge TEXT NOT NULL,
    question TEXT NOT NULL,
    prompt TEXT NOT NULL,
    image_hashes TEXT NOT NULL,
    decoding TEXT NOT NULL,
    raw TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL
)
"""


def image_hash(img: Image.Image) -> str:
    """sha256 of the pixels (mode, size, bytes): independent of how the image is encoded on disk."""
    digest = hashlib.sha256()
    digest.update(f"{img.mode}|{img.size[0]}x{img.size[1]}|".encode())
    digest.update(img.tobytes())
    return digest.hexdigest()


def cache_key(judge_id: str, question_key: str, prompt: str, image_hashes: list[str], decoding: dict) -> str:
    payload = json.dumps(
        [judge_id, question_key, prompt, list(image_hashes), decoding], sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class CachedAnswer:
    raw: str | None
    input_tokens: int = 0
    output_tokens: int = 0


class JudgeCache:
    """Thread-safe SQLite store (WAL mode: readers never block the writer)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")  # each committed answer survives a power cut, not only a crash
            self._conn.execute(_SCHEMA)
            self._conn.commit()

    def get(self, key: str) -> CachedAnswer | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT raw, input_tokens, output_tokens FROM answers WHERE key = ?", (key,)
            ).fetchone()
        return CachedAnswer(*row) if row else None

    def put(self, key: str, *, judge: str, question: str, prompt: str, image_hashes: list[str],
            decoding: dict, answer: CachedAnswer) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                # Stored text passes the secrets scrubber (the key column is a hash and is looked up as is).
                (key, scrub_text(judge), scrub_text(question), scrub_text(prompt), json.dumps(image_hashes),
                 scrub_text(json.dumps(decoding, sort_keys=True)), scrub_text(answer.raw), answer.input_tokens,
                 answer.output_tokens, time.time()),
            )
            self._conn.commit()

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def rows(self, judge: str | None = None) -> list[dict]:
        """All stored answers (for re-parsing or audit), optionally for one judge id."""
        query = "SELECT key, judge, question, prompt, image_hashes, decoding, raw FROM answers"
        args: tuple = ()
        if judge is not None:
            query, args = query + " WHERE judge = ?", (judge,)
        with self._lock:
            rows = self._conn.execute(query, args).fetchall()
        names = ("key", "judge", "question", "prompt", "image_hashes", "decoding", "raw")
        return [dict(zip(names, row)) for row in rows]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __repr__(self) -> str:
        return f"JudgeCache({str(self.path)!r})"
