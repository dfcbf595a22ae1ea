"""Parallel sha256 of many files, using every core.

hashlib releases the GIL while it digests a buffer (and file reads release it too), so plain
threads scale across cores without the pickling and copy costs of processes. Files go to the pool
largest first, so one huge shard does not end up alone at the tail of the run. A stop event lets
Ctrl-C end the run within one chunk per thread; completed results are handed back one by one so a
caller can persist them (resumable hashing).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.bundle.progress import Progress

CHUNK = 4 << 20


class HashInterrupted(Exception):
    """The stop event was set while a file was being hashed."""


@dataclass(frozen=True)
class HashJob:
    key: str
    path: Path
    size: int
    # Bundle files must be regular files reached without a final symlink; model files are not
    # (the Hugging Face cache layout links every file into a blob store).
    regular_only: bool = False


@dataclass(frozen=True)
class HashResult:
    key: str
    size: int
    sha256: str = ""
    error: str = ""


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def sha256_file(
    path: Path,
    on_bytes: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    chunk: int = CHUNK,
    *,
    regular_only: bool = False,
) -> tuple[str, int]:
    """(hex digest, bytes read); reads into one reused buffer so memory stays at `chunk`.

    `regular_only` opens without following a final symlink and without blocking on a FIFO, and
    refuses anything but a regular file (OSError), so a file swapped after a check is not read.
    """
    digest = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    flags = os.O_RDONLY | os.O_CLOEXEC | ((os.O_NOFOLLOW | os.O_NONBLOCK) if regular_only else 0)
    fd = os.open(path, flags)
    if regular_only and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    with open(fd, "rb", buffering=0) as fh:
        try:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            pass
        while True:
            if stop is not None and stop.is_set():
                raise HashInterrupted(str(path))
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            total += n
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest(), total


def _one(job: HashJob, progress: Progress | None, stop: threading.Event) -> HashResult:
    try:
        hexdigest, size = sha256_file(job.path, progress.advance if progress else None, stop,
                                      regular_only=job.regular_only)
    except HashInterrupted:
        raise
    except OSError as exc:
        return HashResult(job.key, -1, "", f"{exc.strerror or exc}")
    return HashResult(job.key, size, hexdigest)


def hash_parallel(
    jobs: Iterable[HashJob],
    workers: int | None = None,
    progress: Progress | None = None,
    on_done: Callable[[HashResult], None] | None = None,
) -> dict[str, HashResult]:
    """Hash every job; `on_done` runs in the calling thread as each file completes.

    KeyboardInterrupt (or any exception in `on_done`) stops the workers within one chunk each and
    re-raises, so no thread keeps reading a 5 GB shard after the user pressed Ctrl-C.
    """
    ordered = sorted(jobs, key=lambda j: (-j.size, j.key))
    results: dict[str, HashResult] = {}
    if not ordered:
        return results
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="sha256")
    try:
        pending: set[Future[HashResult]] = {pool.submit(_one, j, progress, stop) for j in ordered}
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                res = fut.result()
                results[res.key] = res
                if on_done is not None:
                    on_done(res)
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results
