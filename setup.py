"""Build hook: ship the stack lock and the kernel import hook inside the wheel.

Everything else is in pyproject.toml. This exists because two files must land outside the normal
package layout: `stack.lock`/`stack.toml` as package data (`v4flash_pd/_data/`, read by
`v4flash_pd.stacklock` on hosts with no checkout), and `v4flash_kernels_hook.pth` at the wheel
root so it lands directly in site-packages (a .pth only runs from there).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA_FILES = ("stack.lock", "stack.toml")  # -> v4flash_pd/_data/
ROOT_FILES = ("kernels/v4flash_kernels_hook.pth",)  # -> site-packages/ (skipped if absent)


class BuildPyWithStack(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs read the checkout's files directly
        data_dir = Path(self.build_lib) / "v4flash_pd" / "_data"
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in DATA_FILES:
            src = ROOT / name
            if src.is_file():
                shutil.copyfile(src, data_dir / name)
        for rel in ROOT_FILES:
            src = ROOT / rel
            if src.is_file():
                shutil.copyfile(src, Path(self.build_lib) / src.name)


setup(cmdclass={"build_py": BuildPyWithStack})
