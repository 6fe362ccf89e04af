"""One scrubber for secrets: API keys never reach a log line, an error message, a config, a model card,
a report or a cache of judge answers.

What is masked (replaced by ``***``):

- strings shaped like keys: ``sk-...`` (OpenAI), ``sk-ant-...`` (Anthropic), ``AIza...`` (Google),
  ``hf_...`` (Hugging Face), and long random-looking tokens (24+ characters without a separator mixing
  upper case, lower case and digits; a hex digest, a hub id or a word is not one of them);
- the current values of the environment variables that hold keys (``KEY_ENV_VARS``, any variable
  named like one: ``*_API_KEY``, ``*_KEY``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, and any variable a judge's
  ``api_key_env=`` names, whatever its name: ``MY_JUDGE_CRED``), wherever they appear, whatever their shape
  (values shorter than 8 characters are left alone: they would mask ordinary words);
- in mappings (configs): the whole value of a key named like a secret (``api_key``, ``token``, ...).

Used by both packages (``rewards`` never imports ``align``): align's run folders, ``die()`` and
logging go through ``scrub`` / ``scrub_text``; ``install_log_scrubber()`` masks every log record.
"""

from __future__ import annotations

import logging
import os
import re

MASK = "***"

# Environment variables that hold keys; their values are masked wherever they appear.
KEY_ENV_VARS = (
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY",
)
_MIN_ENV_VALUE = 8

# Mapping keys whose values are never written (configs, tracker settings).
_SECRET_NAME = re.compile(r"(api[_-]?key(?!_env)|token|secret|password|authorization)", re.IGNORECASE)

# Not inside a longer run of base64 (an image embedded in a report): preceded by none of its characters.
_KEY_SHAPES = re.compile(
    r"(?<![A-Za-z0-9+/])(sk-ant-[A-Za-z0-9_\-]{8,}"  # Anthropic
    r"|sk-[A-Za-z0-9_\-]{8,}"  # OpenAI (sk-proj-..., sk-...)
    r"|AIza[0-9A-Za-z_\-]{20,}"  # Google
    r"|hf_[A-Za-z0-9]{20,})"  # Hugging Face
)
# A long token of key characters, tested below for randomness (mixed case and digits).
_LONG_TOKEN = re.compile(r"(?<![A-Za-z0-9_\-+/])[A-Za-z0-9_\-]{24,}(?![A-Za-z0-9_\-+/=])")


# The runs a word is made of: a capitalised or lower-case word, an upper-case run, a number.
_WORD_RUN = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")


def _random_looking(token: str) -> bool:
    """A stretch of 24+ characters without a separator that mixes upper case, lower case and digits, in short
    runs: a key or token. Hub ids and names (CLIP-ViT-H-14-laion2B-s32B-b79K), words, hex digests and CamelCase
    identifiers (StableDiffusion3Pipeline: four runs of six characters on average) have no such stretch; a random
    base-62 string changes case or turns to a digit every second character or so."""
    return any(
        len(part) >= 24 and re.search(r"[a-z]", part) and re.search(r"[A-Z]", part) and re.search(r"[0-9]", part)
        and len(_WORD_RUN.findall(part)) * 3 > len(part)  # runs shorter than 3 characters on average
        for part in re.split(r"[_\-]", token)
    )


# Any other variable named like a key holder (MY_JUDGE_KEY, named by a judge's api_key_env=) is masked too.
_SECRET_ENV_NAME = re.compile(r"(API_?KEY|_KEY$|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


# Variables named by a judge's api_key_env= in this process (check_key_env_name registers them): they hold keys
# whatever their names say.
_NAMED_KEY_ENVS: set[str] = set()


def register_key_env(name: str) -> None:
    """Mask the value of the environment variable ``name`` from now on (a judge reads its key there)."""
    _NAMED_KEY_ENVS.add(name)


def secret_env_values() -> list[str]:
    """The current values of the key-holding environment variables (long enough to mask safely)."""
    names = set(KEY_ENV_VARS) | _NAMED_KEY_ENVS | {name for name in os.environ if _SECRET_ENV_NAME.search(name)}
    values = {os.environ.get(name, "").strip() for name in names}
    return sorted((v for v in values if len(v) >= _MIN_ENV_VALUE), key=len, reverse=True)


def looks_like_secret(text: str) -> bool:
    """True when ``text`` holds something that ``scrub_text`` would mask."""
    return isinstance(text, str) and scrub_text(text) != text


def scrub_text(text: str) -> str:
    """``text`` with every key-shaped string and every value of a key-holding variable masked."""
    if not isinstance(text, str) or not text:
        return text
    for value in secret_env_values():
        text = text.replace(value, MASK)
    text = _KEY_SHAPES.sub(MASK, text)
    return _LONG_TOKEN.sub(lambda m: MASK if _random_looking(m.group(0)) else m.group(0), text)


def scrub(obj):
    """A copy of ``obj`` (dicts, lists, tuples, strings) with secrets masked: strings through
    ``scrub_text``, and the whole value of a mapping key named like a secret."""
    if isinstance(obj, dict):
        return {k: (MASK if _SECRET_NAME.search(str(k)) and v else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub(v) for v in obj)
    if isinstance(obj, str):
        return scrub_text(obj)
    return obj


def check_key_env_name(name) -> None:
    """``api_key_env=`` names an environment variable; a key pasted there is refused without being repeated."""
    if name is None:
        return
    if not isinstance(name, str) or looks_like_secret(name) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(
            "api_key_env= must be the NAME of an environment variable that holds the key (e.g. OPENAI_API_KEY); "
            "the value given is not one (it may be a key itself, so it is not repeated here): put the key in "
            "the environment and name its variable"
        )
    register_key_env(name)  # whatever it is called, its value is a key from now on


class ScrubbingFilter(logging.Filter):
    """A logging filter that masks secrets in a record's message (its arguments merged in)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _scrub_record(record)
        return True


def _scrub_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: leave it to logging's own error report
        return
    clean = scrub_text(message)
    if clean != message:
        record.msg, record.args = clean, None


_installed = False


def install_log_scrubber() -> None:
    """Mask secrets in every log record of every logger from now on (idempotent). A record factory, not a
    filter on one logger: filters do not reach records of child loggers, a factory sees all of them."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        _scrub_record(record)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
