"""What a worker's `extra_args` (`engine.extra_args`, `<role>.N.extra_args`) may not pass to SGLang,
judged by what the pinned sglang's argparse would read (abbreviations included, see flagwords).

- A key (`--api-key`, `--admin-api-key`): on a command line `ps`, the `.command` file, the plan and
  the report all show it; the router's key (router.api_key_file / router.api_key_env) reaches the
  workers without that (workerauth).
- An abbreviation of any flag a guard watches (the key flags, `--chunked-prefill-size`, the
  speculative-decoding flags): the guards compare full names, so a prefix would pass them and
  override what the launcher set. Written out in full, the guards judge it.
"""

from __future__ import annotations

from v4flash_pd.config.flagwords import abbreviation, meant, option
from v4flash_pd.config.speculative import GUARDED_FLAGS as SPECULATIVE_FLAGS
from v4flash_pd.config.values import check_extra_chunk
from v4flash_pd.errors import UserError

WORKER_KEY_FLAGS = ("--api-key", "--admin-api-key")
CHUNK_FLAG = "--chunked-prefill-size"
GUARDED = (*WORKER_KEY_FLAGS, CHUNK_FLAG, *SPECULATIVE_FLAGS)
# Options of sglang 0.5.13.post1 that are themselves a prefix of a guarded flag (argparse takes them
# exactly): none. tests/launcher/test_sglang_parser.py keeps this true against the pinned parser.
SHORTER: tuple[str, ...] = ()


def _named(flag: str) -> str:
    return f"the {flag}* flags" if flag.endswith("-") else flag


def check_worker_args(argv: tuple[str, ...], where: str, prefill_chunk: bool) -> None:
    """Refuse a key, or an abbreviation of a guarded flag, in `argv` (`where` names the key); a prefill
    worker's (`prefill_chunk`) chunk size is checked as `engine.chunked_prefill_size` would be."""
    for word in argv:
        key = meant(word, WORKER_KEY_FLAGS, SHORTER)
        if key:
            raise UserError(
                f"{where} passes {option(word)!r}, which SGLang reads as {key}: a key on a worker's command line "
                "shows in `ps`, the .command file, the plan and the report",
                f"drop it from {where}; to demand a key, set router.api_key_file (or router.api_key_env): the "
                "router asks clients for it and the launcher hands the same key to the workers, never on a "
                "command line")
    for word in argv:
        flag = abbreviation(word, GUARDED, SHORTER)
        if flag:
            full = flag if not flag.endswith("-") else flag + "<name>"
            raise UserError(
                f"{where} passes {option(word)!r}, an abbreviation that SGLang's argparse expands to {_named(flag)} "
                "(or refuses as ambiguous); the launcher checks that flag by its full name, so an abbreviation "
                "would slip past the check and override what the launcher set",
                f"write the flag out in full ({full}) in {where}")
    if prefill_chunk:
        check_extra_chunk(argv, where)
