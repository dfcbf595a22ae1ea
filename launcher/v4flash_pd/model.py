"""Model directory checks that must happen before minutes of weight loading, not after."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelCheck:
    path: str
    exists: bool
    has_config: bool
    problem: str = ""  # one sentence, empty when fine

    @property
    def ok(self) -> bool:
        return self.exists and self.has_config and not self.problem


def check_model_dir(path: str) -> ModelCheck:
    if not path:
        return ModelCheck(path, False, False, "no model path is configured (model.path / --model)")
    p = Path(path)
    try:
        if p.is_file():
            return ModelCheck(path, True, False, f"model path {path} is a file, not a directory "
                                                 "(point model.path at the checkpoint directory that holds config.json)")
        if not p.is_dir():
            return ModelCheck(path, False, False, f"model directory {path} does not exist")
        if not os.access(p, os.R_OK | os.X_OK):
            return ModelCheck(path, True, False, f"model directory {path} is not readable by this user (permission denied)")
        cfg = p / "config.json"
        if not cfg.is_file():
            return ModelCheck(path, True, False,
                              f"model directory {path} has no config.json (not a Hugging Face checkpoint dir?)")
        if not os.access(cfg, os.R_OK):
            return ModelCheck(path, True, True, f"{cfg} is not readable by this user (permission denied)")
    except OSError as exc:
        return ModelCheck(path, False, False, f"model path {path} cannot be inspected: {exc.strerror or exc}")
    return ModelCheck(path, True, True)
