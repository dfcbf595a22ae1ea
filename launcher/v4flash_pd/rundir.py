"""RunDir: the only state `status`, `logs` and `down` read.

Layout: config.json (resolved), plan.json, fingerprint.json, state.json, events.jsonl,
<name>.log / <name>.command / <name>.pid per process, patch/ (per-worker kernel patch status).
`<runs root>/latest` points at the newest run so `status`/`down` need no --run-dir.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v4flash_pd.errors import UserError


def runs_root() -> Path:
    return Path(os.environ.get("V4FLASH_RUNS_ROOT", "runs"))


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: Path | None = None) -> "RunDir":
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
    def find(cls, path: Path | None) -> "RunDir":
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

    def file(self, name: str) -> Path:
        return self.path / name

    def log(self, proc: str) -> Path:
        return self.path / f"{proc}.log"

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(self.path / name)

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text())

    def state(self) -> dict[str, Any]:
        try:
            return self.read_json("state.json")
        except (OSError, json.JSONDecodeError):
            return {}

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
        out = []
        for p in sorted((self.path / "patch").glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        return out
