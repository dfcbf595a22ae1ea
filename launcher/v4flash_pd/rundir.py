"""RunDir: the only state `status`, `logs` and `down` read.

Layout: config.json (resolved), plan.json, fingerprint.json, state.json, events.jsonl,
<name>.log / <name>.command / <name>.pid per process, patch/ (per-worker kernel patch status),
selfcheck.json + selfcheck/ (the kernel self-check `up` ran first).
`<runs root>/latest` points at the newest run so `status`/`down` need no --run-dir.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v4flash_pd.errors import UserError
from v4flash_pd.procgroup import Identity, Signaller, parse_pid_file
from v4flash_pd.textfile import read_json_record, read_record


def runs_root() -> Path:
    return Path(os.environ.get("V4FLASH_RUNS_ROOT", "runs"))


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: Path | None = None) -> RunDir:
        root = runs_root().absolute()
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = root / stamp
            n = 1
            while path.exists():
                n += 1
                path = root / f"{stamp}-{n}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "patch").mkdir(exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create run dir {path}: {exc.strerror}",
                            "pass a writable --run-dir, or set V4FLASH_RUNS_ROOT") from None
        path = path.absolute()
        if path.parent.resolve() == root.resolve():
            latest = root / "latest"
            try:
                if latest.is_symlink() or latest.exists():
                    latest.unlink()
                latest.symlink_to(path.name)
            except OSError:
                pass
        return cls(path)

    @classmethod
    def find(cls, path: Path | None) -> RunDir:
        if path is None:
            latest = runs_root() / "latest"
            if not latest.exists():
                raise UserError(f"no run found under {runs_root()}/",
                                "pass --run-dir DIR (the directory `up` printed), or set V4FLASH_RUNS_ROOT")
            path = latest.resolve()
        if not (path / "state.json").is_file():
            raise UserError(f"{path} is not a v4flash-pd run dir (no state.json)",
                            "pass the directory `v4flash-pd up` printed as its run dir")
        return cls(path)

    def lock(self) -> int:
        """Hold an exclusive flock on `<run>/.lock` for the life of this process (the fd is returned
        and never closed; the kernel drops the lock when the launcher exits, however it exits).
        Two `up` on one run dir would otherwise interleave pids, state, logs and self-check verdicts.
        `up` takes it before its self-check and `run_launch` asks again: a lock this process already
        holds (or adopted from the `up` that detached it) is returned as it is."""
        path = self.path / ".lock"
        held = _HELD_LOCKS.get(_lock_key(path))
        if held is not None:
            return held
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            what = "is not writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "cannot be locked"
            raise UserError(f"run dir {self.path} {what} (its lock file {path.name}: {exc.strerror})",
                            "pass a writable --run-dir, or set V4FLASH_RUNS_ROOT to a writable directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise UserError(f"run dir {self.path} is in use by another `v4flash-pd up` (pid {holder})",
                            f"stop that run first (`v4flash-pd down --run-dir {self.path}`), or give this one "
                            "its own --run-dir") from None
        _hold(path, fd)
        return fd

    def adopt_lock(self, fd: int) -> None:
        """Take over the lock an `up` holds and handed down (`up --detach`'s background launcher
        inherits the descriptor, so the run dir is never unlocked between the two); UserError when
        `fd` is not this run dir's lock file."""
        path = self.path / ".lock"
        try:
            mine, theirs = os.fstat(fd), os.stat(path)
        except OSError as exc:
            raise UserError(f"the lock of run dir {self.path} was not handed down (fd {fd}: {exc.strerror})",
                            "start runs with `v4flash-pd up --detach`; this entry point is its background half") from None
        if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
            raise UserError(f"fd {fd} is not the lock of run dir {self.path}",
                            "start runs with `v4flash-pd up --detach`; this entry point is its background half")
        os.set_inheritable(fd, False)  # its workers must not hold the run dir
        _hold(path, fd)

    def file(self, name: str) -> Path:
        return self.path / name

    def log(self, proc: str) -> Path:
        return self.path / f"{proc}.log"

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(self.path / name)

    def read_json(self, name: str) -> Any:
        """A record of the run dir: OSError for the file (a FIFO or a huge file too: anyone who can write
        the run dir can plant one), ValueError for what it holds."""
        return read_json_record(self.path / name)

    def state(self) -> dict[str, Any]:
        try:
            state = self.read_json("state.json")
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def read_state(self) -> tuple[dict[str, Any], str]:
        """(state, problem): problem is '' when state.json parsed as a JSON object."""
        try:
            st = self.read_json("state.json")
        except OSError as exc:
            return {}, f"cannot read state.json: {exc.strerror}"
        except ValueError as exc:
            return {}, f"state.json is corrupt ({exc})"
        if not isinstance(st, dict):
            return {}, "state.json is corrupt (not a JSON object)"
        return st, ""

    def identities(self) -> tuple[dict[str, Identity], Identity | None, str]:
        """(process identities by name, the launcher's, where they came from) for `down`/`status`.

        From state.json; when that is unreadable, from the `<name>.pid` files (same identities,
        written at start). A bare pid without its identity is never returned: it cannot be verified."""
        st, problem = self.read_state()
        procs: dict[str, Identity] = {}
        launcher = None
        recorded = st.get("procs") or {}
        if not isinstance(recorded, dict):
            problem = problem or f"state.json is corrupt (procs is a JSON {type(recorded).__name__}, not a table)"
        if not problem:
            for name, d in recorded.items():
                try:
                    procs[str(name)] = Identity.from_dict(d)
                except (ValueError, TypeError, AttributeError):
                    continue
            if isinstance(st.get("launcher"), dict):
                try:
                    launcher = Identity.from_dict(st["launcher"])
                except (ValueError, TypeError):
                    launcher = None
            if procs or launcher:
                return procs, launcher, "state.json"
        for f in sorted(self.path.glob("*.pid")):
            try:
                ident = parse_pid_file(read_record(f).decode("utf-8", "replace"))
            except OSError:
                continue
            if ident is None:
                continue
            if f.stem == "launcher":
                launcher = ident
            else:
                procs[f.stem] = ident
        return procs, launcher, (f"{problem}; used the .pid files" if problem else ".pid files")

    def live_ports(self) -> set[int]:
        """The ports this run's processes listen on while they are alive (by their recorded identity, so a
        reused pid is not this run's): what `doctor` beside a running run tells apart from a stranger's."""
        try:
            plan = self.read_json("plan.json")
        except (OSError, ValueError):
            return set()
        procs = plan.get("processes") if isinstance(plan, dict) else None
        if not isinstance(procs, list):
            return set()
        idents, _, _ = self.identities()
        sig = Signaller()
        held: set[int] = set()
        for p in procs:
            name = p.get("name") if isinstance(p, dict) else None
            ident = idents.get(name) if isinstance(name, str) else None
            if ident is not None and sig.alive(ident):
                held |= {u["port"] for u in p.get("ports") or [] if isinstance(u, dict) and isinstance(u.get("port"), int)}
        return held

    def is_rehearsal(self) -> bool:
        try:
            plan = self.read_json("plan.json")
        except (OSError, ValueError):
            return False
        return isinstance(plan, dict) and plan.get("rehearse") is True

    def set_state(self, **fields: Any) -> None:
        st = self.state()
        st.update(fields)
        st["updated"] = time.time()
        self.write_json("state.json", st)

    def event(self, kind: str, **fields: Any) -> None:
        with open(self.path / "events.jsonl", "a") as f:
            f.write(json.dumps({"t": round(time.time(), 3), "event": kind, **fields}, default=str) + "\n")

    def tail(self, proc: str, n: int = 40) -> list[str]:
        try:
            with open(self.log(proc), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []
        return lines[-n:] if n > 0 else []

    def patch_status(self) -> list[dict[str, Any]]:
        """Every worker process's kernel patch report (`patch/patch-<pid>.json`), normalized."""
        out: list[dict[str, Any]] = []
        for p in sorted((self.path / "patch").glob("patch-*.json")):
            try:
                data = self.read_json(str(p.relative_to(self.path)))
            except (OSError, ValueError) as exc:
                why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
                out.append({"pid": _pid_of(p.name), "file": p.name, "patches": {}, "error": "unreadable", "why": why})
                continue
            rec = normalize_patch_status(data)
            if rec["pid"] is None:
                rec["pid"] = _pid_of(p.name)
            rec["file"] = p.name
            out.append(rec)
        return out


_HELD_LOCKS: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a run dir's .lock -> the fd holding it


def _lock_key(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def _hold(path: Path, fd: int) -> None:
    """Record `fd` as this process's lock of `path` and write our pid into it (what a refused `up` shows)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the lock itself is what matters
    st = os.fstat(fd)
    _HELD_LOCKS[(st.st_dev, st.st_ino)] = fd


def _pid_of(filename: str) -> int | None:
    stem = filename[len("patch-"):].split(".", 1)[0]
    return int(stem) if stem.isdigit() else None


def normalize_patch_status(data: Any) -> dict[str, Any]:
    """{"pid", "patches": {name: {"active": bool, "reason": str, ...}}} from either file format:
    today's one entry per patch, or the older flat {"pid", "active", "reason"} (sparse decode only)."""
    if not isinstance(data, dict):
        return {"pid": None, "patches": {}, "error": "not a JSON object"}
    pid = data.get("pid") if isinstance(data.get("pid"), int) else None
    patches = data.get("patches")
    if isinstance(patches, dict):
        norm = {}
        for name, p in patches.items():
            if isinstance(p, dict):
                norm[str(name)] = {**p, "active": bool(p.get("active")), "reason": str(p.get("reason") or "")}
        return {"pid": pid, "patches": norm}
    if "active" in data:
        return {"pid": pid, "patches": {"sparse_decode": {"active": bool(data.get("active")),
                                                          "reason": str(data.get("reason") or "")}}}
    return {"pid": pid, "patches": {}, "error": "no patch entries"}
