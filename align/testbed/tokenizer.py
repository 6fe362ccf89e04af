"""A CLIP tokenizer whose vocabulary holds every word of the shapes grammar as one token.

The vocabulary has CLIP's layout: the 256 byte-level symbols, the same symbols with the
end-of-word marker ``</w>``, the merged tokens, then ``<|startoftext|>`` and ``<|endoftext|>``
(so, as in CLIP, the end token has the highest id). Any text still tokenizes (byte by byte);
grammar words come out whole, so the tiny text encoders see one token per word. The files are
plain ``vocab.json`` + ``merges.txt`` and load with ``CLIPTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from rewards import shapes_grammar as grammar

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
END_OF_WORD = "</w>"
# 77 like every CLIP text encoder, so code written for real CLIPs needs no special case.
MODEL_MAX_LENGTH = 77

# Words the grammar's parser also accepts ("an", "one", "to the left of", "on the right of") and
# the group joiner "and"; commas and full stops tokenize as single byte-level symbols anyway.
CONNECTIVE_WORDS = ("a", "an", "one", "and", "to", "the", "on", "of")

_WORD = re.compile(r"[a-z]+")


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for the bytes 0..255, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:  # control bytes and spaces map to code points from 256 upwards
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Standard BPE: repeatedly merge the adjacent pair with the lowest rank."""
    while len(symbols) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
    return symbols


def whole_word_merges(words: Iterable[str]) -> list[tuple[str, str]]:
    """BPE merges that turn each word into a single ``word</w>`` token.

    Each round adds one merge for the first pair of some word that is not yet whole; a new
    merge has the lowest priority, so it never undoes what earlier merges produce, and the
    total number of pieces strictly shrinks, so the loop ends.
    """
    vocabulary = sorted(set(words))
    for word in vocabulary:
        if not _WORD.fullmatch(word):
            raise ValueError(f"tokenizer word {word!r} must be lowercase ASCII letters a-z only")
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    changed = True
    while changed:
        changed = False
        for word in vocabulary:
            pieces = _apply_merges(list(word[:-1]) + [word[-1] + END_OF_WORD], ranks)
            if len(pieces) > 1:
                pair = (pieces[0], pieces[1])
                ranks[pair] = len(merges)
                merges.append(pair)
                changed = True
    return merges


def vocab_and_merges(words: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The ``vocab.json`` mapping and the ``merges.txt`` pairs for a word list."""
    merges = whole_word_merges(words)
    symbols = byte_symbols()
    tokens = symbols + [s + END_OF_WORD for s in symbols]
    seen = set(tokens)
    for left, right in merges:
        merged = left + right
        if merged not in seen:
            tokens.append(merged)
            seen.add(merged)
    tokens += [BOS_TOKEN, EOS_TOKEN]
    return {token: i for i, token in enumerate(tokens)}, merges


def build_tokenizer(words: Iterable[str]):
    """A ``transformers.CLIPTokenizer`` in which every word of ``words`` is a single token."""
    from transformers import CLIPTokenizer

    vocab, merges = vocab_and_merges(words)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_tokenizer(folder: str | Path, words: Iterable[str]):
    """Write ``vocab.json`` + ``merges.txt`` (and transformers' own files) and load them back.

    The plain BPE files keep the folder readable by any CLIP tokenizer implementation;
    ``save_pretrained`` then adds ``tokenizer.json`` and ``tokenizer_config.json`` (which
    records ``model_max_length``). Returns the tokenizer loaded from the folder.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = vocab_and_merges(words)
    _write_text_atomically(folder / "vocab.json", json.dumps(vocab, ensure_ascii=False, indent=0))
    merge_lines = "".join(f"{a} {b}\n" for a, b in merges)
    _write_text_atomically(folder / "merges.txt", "#version: 0.2\n" + merge_lines)
    tokenizer = CLIPTokenizer.from_pretrained(
        folder,
        unk_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )
    tokenizer.save_pretrained(folder)
    return CLIPTokenizer.from_pretrained(folder)


def grammar_words() -> list[str]:
    """Every word the shapes grammar reads: counts, sizes, colours, shapes (and plurals), relations."""
    words = set(CONNECTIVE_WORDS)
    words.update(grammar.COUNT_WORDS.values())
    words.update(grammar.SIZE_WORDS)
    words.update(grammar.SIZES)
    words.update(grammar.COLOURS)
    words.update(grammar.SHAPES)
    words.update(shape + "s" for shape in grammar.SHAPES)
    for relation in grammar.RELATIONS:
        words.update(relation.split())
    words.update(getattr(grammar, "VOCABULARY", ()))
    return sorted(words)


def testbed_tokenizer():
    """The tokenizer shared by the testbed pipeline's text encoder and by shapes-clip."""
    return build_tokenizer(grammar_words())
