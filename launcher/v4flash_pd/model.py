"""Model directory checks that must happen before minutes of weight loading, not after."""

from __future__ import annotations

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
        return self.exists and self.has_config


def check_model_dir(path: str) -> ModelCheck:
    if not path:
        return ModelCheck(path, False, False, "no model path is configured (model.path / --model)")
    p = Path(path)
    if not p.is_dir():
        return ModelCheck(path, False, False, f"model directory {path} does not exist")
    if not (p / "config.json").is_file():
        return ModelCheck(path, True, False, f"model directory {path} has no config.json (not a Hugging Face checkpoint dir?)")
    return ModelCheck(path, True, True)
