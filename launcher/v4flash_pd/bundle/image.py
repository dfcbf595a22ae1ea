"""Image save/load through the Docker Engine API (docker, or podman's compatible socket), zstd.

Everything streams: `docker save` output is compressed and hashed chunk by chunk on its way to
disk, and `load` feeds the engine from a decompressing generator, so a 20 GB image never sits in
memory. The archive is one zstd frame with a content checksum; reading it back checks the frame
end to end, the tar structure, and that the config blob hashes to the recorded image ID, which
is exactly the ID `docker load` will report.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from v4flash_pd.bundle.progress import Progress
from v4flash_pd.errors import RuntimeFailure, UserError

READ_CHUNK = 1 << 20
ENGINE_HINT = (
    "start the engine (dockerd, or `podman system service unix:///run/podman/podman.sock`), then "
    "point DOCKER_HOST or --engine at it (e.g. --engine unix:///run/podman/podman.sock)"
)

@dataclass(frozen=True)
class ImageRecord:
    """What MANIFEST.json records about the saved image."""

    id: str
    repo_tags: tuple[str, ...]
    tar_sha256: str
    tar_size: int
    labels: dict[str, str] = field(default_factory=dict)

    def to_dict(self, path: str) -> dict[str, Any]:
        return {
            "path": path,
            "id": self.id,
            "repo_tags": list(self.repo_tags),
            "tar_sha256": self.tar_sha256,
            "tar_size": self.tar_size,
            "labels": dict(self.labels),
            "compression": "zstd",
        }

@dataclass(frozen=True)
class ArchiveInfo:
    """What reading an archive back found (all from the archive itself, no engine)."""

    tar_sha256: str
    tar_size: int
    config_id: str
    repo_tags: tuple[str, ...]

def connect(engine: str | None = None) -> Any:
    """A DockerClient for `engine` (unix:///..., tcp://...), else DOCKER_HOST / the default socket."""
    import docker  # imported here: `verify` without an image never needs it

    try:
        client = docker.DockerClient(base_url=engine) if engine else docker.from_env()
        client.version()
    except docker.errors.DockerException as exc:
        where = engine or os.environ.get("DOCKER_HOST") or "the default socket (/var/run/docker.sock)"
        raise RuntimeFailure(f"cannot reach the container engine at {where}: {exc}", ENGINE_HINT) from exc
    return client

class _HashingWriter(io.RawIOBase):
    """Passes bytes to a file while hashing and counting them (the compressed side)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.fh.write(data)
        return len(data)

def save_image(client: Any, ref: str, dest: Path, level: int = 3, progress: Progress | None = None) -> ImageRecord:
    """Stream `ref` out of the engine into `dest` (zstd, one frame, checksummed)."""
    import docker

    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound as exc:
        raise UserError(
            f"image {ref} is not in the container engine",
            "build it first (`make image`), pass --image REF naming a local image, or --no-image",
        ) from exc
    except docker.errors.APIError as exc:
        raise RuntimeFailure(f"the engine failed to look up image {ref}: {exc}", ENGINE_HINT) from exc
    if progress is not None:
        progress.start(int(image.attrs.get("Size") or 0))
    raw_sha = hashlib.sha256()
    raw_size = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    try:
        with open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            with cctx.stream_writer(writer, closefd=False) as zw:  # type: ignore[arg-type]  # a raw binary writer
                for chunk in client.api.get_image(ref, chunk_size=READ_CHUNK):
                    raw_sha.update(chunk)
                    raw_size += len(chunk)
                    zw.write(chunk)
                    if progress is not None:
                        progress.advance(len(chunk))
            fh.flush()
            os.fsync(fh.fileno())
    except docker.errors.APIError as exc:
        raise RuntimeFailure(f"the engine failed to save image {ref}: {exc}", ENGINE_HINT) from exc
    os.replace(tmp, dest)
    if progress is not None:
        progress.finish()
    labels = (image.attrs.get("Config") or {}).get("Labels") or {}
    return ImageRecord(image.id, tuple(image.tags), raw_sha.hexdigest(), raw_size, dict(labels))

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def check_frame(path: Path) -> None:
    """Walk the zstd frame's block headers: complete, one frame, nothing after it.

    python-zstandard's streaming readers stop quietly at a truncated end, and decompressobj (which
    does notice) has unbounded output; so structure is checked here (3 bytes read per <=128 KiB
    block) and content by the frame checksum while decompressing.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(5)
        if len(head) < 5 or head[:4] != _ZSTD_MAGIC:
            raise ValueError("not a zstd archive (bad magic number)")
        fhd = head[4]
        single_segment = (fhd >> 5) & 1
        pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[fhd & 3] + ((1 if single_segment else 0), 2, 4, 8)[fhd >> 6]
        while True:
            if pos + 3 > size:
                raise ValueError("the zstd frame ends early (the archive is truncated)")
            fh.seek(pos)
            hdr = int.from_bytes(fh.read(3), "little")
            btype, bsize = (hdr >> 1) & 3, hdr >> 3
            if btype == 3:
                raise ValueError(f"zstd data is corrupt (reserved block type at byte {pos})")
            pos += 3 + (1 if btype == 1 else bsize)
            if hdr & 1:
                break
        pos += 4 if (fhd >> 2) & 1 else 0
    if pos > size:
        raise ValueError("the zstd frame ends early (the archive is truncated)")
    if pos < size:
        raise ValueError(f"unexpected bytes after the end of the zstd frame ({size - pos} bytes)")


def decompressed_chunks(path: Path, progress: Progress | None = None) -> Iterator[bytes]:
    """Decompress the archive in bounded chunks; ValueError if damaged, truncated or followed by junk.

    The frame structure is checked before the first byte is yielded, so `load` never starts
    feeding the engine a truncated archive.
    """
    check_frame(path)
    with open(path, "rb") as fh:
        last = 0
        try:
            for chunk in zstandard.ZstdDecompressor().read_to_iter(fh, read_size=READ_CHUNK, write_size=READ_CHUNK):
                if progress is not None:
                    pos = fh.tell()
                    progress.advance(pos - last)
                    last = pos
                yield chunk
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd data is corrupt ({exc})") from exc


class _ChunkReader(io.RawIOBase):
    """A read() view over a chunk iterator that hashes every byte it hands out (for tarfile).

    Keeps the current chunk plus an offset: tarfile reads 10 KiB at a time from multi-MB chunks,
    and re-slicing the remainder on every read would copy each chunk hundreds of times.
    """

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.cur = b""
        self.pos = 0
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        parts = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            if self.pos >= len(self.cur):
                nxt = next(self.chunks, None)
                if nxt is None:
                    break
                self.cur, self.pos = nxt, 0
            take = self.cur[self.pos : self.pos + want]
            self.pos += len(take)
            want -= len(take)
            parts.append(take)
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self.sha.update(out)
        self.size += len(out)
        return out

    def drain(self) -> None:
        while self.read(READ_CHUNK):
            pass


def _config_id(config_name: str) -> str:
    """`<hex>.json` (docker-archive) or `blobs/sha256/<hex>` (OCI layout in docker >= 25)."""
    base = config_name.rsplit("/", 1)[-1]
    return "sha256:" + (base[:-5] if base.endswith(".json") else base)

def read_archive(path: Path, progress: Progress | None = None) -> ArchiveInfo:
    """Read an archive end to end; ValueError says what is wrong with it."""
    reader = _ChunkReader(decompressed_chunks(path, progress))
    manifest: list[dict[str, Any]] | None = None
    config_hashes: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=reader, mode="r|", bufsize=READ_CHUNK) as tf:
            for member in tf:
                if not member.isfile():
                    continue
                if member.name == "manifest.json":
                    fobj = tf.extractfile(member)
                    manifest = json.loads(fobj.read()) if fobj else None
                elif member.size < (16 << 20) and (member.name.endswith(".json") or "blobs/sha256/" in member.name):
                    fobj = tf.extractfile(member)
                    if fobj is not None:
                        config_hashes[member.name] = hashlib.sha256(fobj.read()).hexdigest()
        reader.drain()
    except tarfile.TarError as exc:
        raise ValueError(f"the image tar inside is damaged ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError("the image tar's manifest.json is not valid JSON") from exc
    if not manifest or not isinstance(manifest, list) or "Config" not in manifest[0]:
        raise ValueError("no docker-archive manifest.json in the image tar (not a `docker save` archive?)")
    config_name = manifest[0]["Config"]
    config_id = _config_id(config_name)
    actual = config_hashes.get(config_name)
    if actual is None:
        raise ValueError(f"the image config {config_name} is missing from the tar")
    if "sha256:" + actual != config_id:
        raise ValueError(f"the image config {config_name} does not hash to its ID (content damaged)")
    return ArchiveInfo(reader.sha.hexdigest(), reader.size, config_id, tuple(manifest[0].get("RepoTags") or ()))

def load_archive(client: Any, path: Path, progress: Progress | None = None) -> list[str]:
    """Stream the archive into the engine; returns the engine's status lines."""
    import docker

    lines: list[str] = []
    try:
        for msg in client.api.load_image(decompressed_chunks(path, progress)):
            if isinstance(msg, dict):
                if msg.get("error"):
                    raise RuntimeFailure(
                        f"the engine refused {path}: {msg['error']}",
                        "check the engine's log and free disk space, then run `bundle load` again",
                    )
                text = msg.get("stream") or msg.get("status") or ""
                if text.strip():
                    lines.append(text.strip())
    except docker.errors.APIError as exc:
        raise RuntimeFailure(f"the engine failed to load {path}: {exc}", ENGINE_HINT) from exc
    return lines

def image_id_of(client: Any, ref: str) -> str | None:
    import docker

    try:
        return str(client.images.get(ref).id)
    except docker.errors.ImageNotFound:
        return None

def lock_label_mismatches(labels: dict[str, str], lock_sha256: str) -> list[str]:
    """Image labels that carry a lock hash (org.v4flash.stack.lock.sha256) but a different one.

    A build without the hash (the Dockerfile's default "unknown") is not a mismatch.
    """
    return [
        f"{k}={v}"
        for k, v in sorted(labels.items())
        if "lock" in k.lower() and k.lower().endswith("sha256")
        and v not in ("", "unknown") and v.removeprefix("sha256:") != lock_sha256
    ]
