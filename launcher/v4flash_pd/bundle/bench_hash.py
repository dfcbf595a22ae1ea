"""Benchmark (not a test): model-manifest hashing throughput vs the machine's limits.

    python -m v4flash_pd.bundle.bench_hash --dir /path/on/the/model/disk --size-gb 4

Writes a synthetic model dir (N shard files), then for each method evicts the files from the page
cache (posix_fadvise DONTNEED, no root needed) and times a cold read, then repeats warm:
  - raw read (`cat`-style, 4 MiB buffers), 1 thread and all threads (the disk limit)
  - `sha256sum` over all files (coreutils, one process)
  - single-thread sha256 (our reader, 1 thread)
  - the manifest hasher on all cores (what `bundle create --model` uses)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from v4flash_pd.bundle.hashing import HashJob, default_workers, hash_parallel


def make_dir(root: Path, size_gb: float, files: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    per = int(size_gb * 1e9 / files)
    block = os.urandom(16 << 20)
    paths = []
    for i in range(files):
        p = root / f"model-{i:05d}-of-{files:05d}.safetensors"
        if not (p.is_file() and p.stat().st_size == per):
            with open(p, "wb") as fh:
                fh.write(os.urandom(64))
                left = per - 64
                while left > 0:
                    n = min(left, len(block))
                    fh.write(block[:n])
                    left -= n
        paths.append(p)
    return paths


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path]) -> None:
    buf = bytearray(4 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def raw_read_parallel(paths: list[Path], workers: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: raw_read([p]), paths))


def sha256sum(paths: list[Path]) -> None:
    subprocess.run(["sha256sum", *map(str, paths)], check=True, stdout=subprocess.DEVNULL)


def ours(paths: list[Path], workers: int) -> None:
    hash_parallel([HashJob(p.name, p, p.stat().st_size) for p in paths], workers=workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the synthetic model (default: a tmp dir)")
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic dir")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="v4flash-bench-"))
    paths = make_dir(root / "model", args.size_gb, args.files)
    total = sum(p.stat().st_size for p in paths)
    workers = default_workers()
    methods: list[tuple[str, Callable[[], object]]] = [
        ("raw read, 1 thread", lambda: raw_read(paths)),
        (f"raw read, {workers} threads (disk limit)", lambda: raw_read_parallel(paths, workers)),
        ("sha256sum (coreutils, 1 proc)", lambda: sha256sum(paths)),
        ("sha256, 1 thread", lambda: ours(paths, 1)),
        (f"manifest hasher, {workers} threads", lambda: ours(paths, workers)),
    ]
    print(f"{len(paths)} files, {total / 1e9:.2f} GB in {root}; {os.cpu_count()} CPUs, {workers} usable")
    print(f"{'method':36} {'cold MB/s':>10} {'warm MB/s':>10}")
    try:
        for name, fn in methods:
            evict(paths)
            t = time.perf_counter()
            fn()
            cold = total / (time.perf_counter() - t) / 1e6
            t = time.perf_counter()
            fn()
            warm = total / (time.perf_counter() - t) / 1e6
            print(f"{name:36} {cold:10.0f} {warm:10.0f}", flush=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
