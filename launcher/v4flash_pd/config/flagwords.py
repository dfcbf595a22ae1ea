"""Which flag a word of `extra_args` is to an argparse parser, for the guards that watch for flags.

argparse (SGLang's and sglang-router's parsers keep `allow_abbrev` on) reads a word as an option
when it is the option (`--flag`, `--flag=V`) or any prefix of exactly one option (`--api-k`,
`--api-k=V`); a prefix of several is an error at start. A guard that compares full names only is
passed by an abbreviation, so guards ask here: a word that abbreviates a guarded flag means that
flag or fails the parser, and either way it is not what the guard lets through. The exception is a
word that is itself a (shorter) option of the parser: argparse matches it exactly first.
"""

from __future__ import annotations

import re
from typing import Iterable

_SPLIT = re.compile(r"[=\s]")


def option(word: str) -> str:
    """The option part of an argv word (`--flag=V` -> `--flag`), or '' for a word that is no long option.
    A word with whitespace after the option (`--flag V` as one list item) counts as that option too:
    it never reaches the parser as intended, and it must not slip past a guard."""
    if not word.startswith("--") or len(word) < 3:
        return ""
    return _SPLIT.split(word, maxsplit=1)[0]


def meant(word: str, flags: Iterable[str], shorter: Iterable[str] = ()) -> str:
    """The flag of `flags` that argparse could read `word` as (exactly, or as its abbreviation), or ''.

    `shorter`: options of the parser that are themselves a prefix of a flag in `flags` (argparse
    takes those exactly, so they abbreviate nothing). A flag ending in '-' names a family
    (`--speculative-`): a word of the family is the family, and so is a prefix of the family's name."""
    opt = option(word)
    if not opt or opt in set(shorter):
        return ""
    for flag in flags:
        if opt == flag or flag.startswith(opt) or (flag.endswith("-") and opt.startswith(flag)):
            return flag
    return ""


def abbreviation(word: str, flags: Iterable[str], shorter: Iterable[str] = ()) -> str:
    """The flag of `flags` that `word` abbreviates (a proper prefix of it), or ''."""
    opt = option(word)
    flag = meant(word, flags, shorter)
    if not flag or opt == flag or (flag.endswith("-") and opt.startswith(flag)):
        return ""
    return flag
