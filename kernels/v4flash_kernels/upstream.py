"""Load pinned upstream code (sglang 0.5.13.post1) for comparison, from the wheel, at run time.

Upstream code is never committed here. A file is read from an installed sglang, or from the pinned
wheel (`$V4FLASH_SGLANG_WHEEL`, else `.cache/wheels/sglang-0.5.13.post1-*.whl` under the repository
root; any zip holding the wheel's `sglang/...` paths works, e.g. a cut-down one carried to a GPU box),
written to a temp dir (Triton's JIT reads its kernels' source from a real file) and imported under a
private name so it never shadows sglang's own module.

Two ways in:
- `load_module(path)`: the whole file, for files whose imports resolve without sglang (the sm_120
  Triton kernels import only torch/triton).
- `load_defs(path, names, prelude)`: just the named top-level definitions, for files whose module
  top imports half of sglang (the indexer, the FP8 GEMM file); the bodies are upstream's, verbatim,
  and `prelude` supplies the names they use.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import importlib.util
import os
import tempfile
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterable, Tuple

MODULE_PATH = "sglang/srt/layers/attention/flash_mla_sm120_triton.py"
MOE_PATH = "sglang/srt/layers/moe/fused_moe_triton/mxfp4_moe_sm120_triton.py"
INDEXER_PATH = "sglang/srt/layers/attention/dsv4/indexer.py"
FP8_KERNEL_PATH = "sglang/srt/layers/quantization/fp8_kernel.py"
WHEEL_GLOB = "sglang-0.5.13.post1-*.whl"
_modules: Dict[str, ModuleType] = {}


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_wheel() -> str | None:
    env = os.environ.get("V4FLASH_SGLANG_WHEEL")
    if env:
        return env
    hits = sorted(glob.glob(str(_repo_root() / ".cache" / "wheels" / WHEEL_GLOB)))
    return hits[-1] if hits else None


def source_of(path: str) -> Tuple[str, str]:
    """(source text, where it came from) of a file of the pinned sglang, e.g. `sglang/srt/x.py`."""
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc).parent / path
            if p.is_file():
                return p.read_text(), str(p)
    wheel = find_wheel()
    if wheel is None:
        raise FileNotFoundError(
            f"upstream file {path} not found: install sglang 0.5.13.post1 or set V4FLASH_SGLANG_WHEEL "
            f"(looked for .cache/wheels/{WHEEL_GLOB})"
        )
    with zipfile.ZipFile(wheel) as z:
        return z.read(path).decode(), f"{wheel}!{path}"


def _import_text(text: str, key: str, origin: str) -> ModuleType:
    """Import `text` from a real temp file under a private module name; cached by `key`."""
    if key in _modules:
        return _modules[key]
    tag = hashlib.sha256(key.encode()).hexdigest()[:10]
    d = tempfile.mkdtemp(prefix="v4flash-upstream-")
    name = f"_v4flash_upstream_{tag}"
    path = os.path.join(d, f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__v4flash_origin__ = origin  # type: ignore[attr-defined]
    _modules[key] = mod
    return mod


def load_module(path: str = MODULE_PATH) -> ModuleType:
    """Import a whole upstream file from its source (its imports must resolve here)."""
    text, origin = source_of(path)
    return _import_text(text, f"module:{path}", origin)


def load_upstream() -> ModuleType:
    """Upstream's sparse-MLA module; its `flash_mla_sparse_decode_triton` is the baseline."""
    return load_module(MODULE_PATH)


def extract_defs(text: str, names: Iterable[str]) -> str:
    """The source of the named top-level defs/classes/assignments (decorators included), in file order.

    Raises KeyError naming what is missing, so a renamed upstream function fails loudly.
    """
    wanted = set(names)
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    found, parts = set(), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node_names = {node.name}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            node_names = {t.id for t in targets if isinstance(t, ast.Name)}
        else:
            continue
        hit = node_names & wanted
        if not hit:
            continue
        found |= hit
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        parts.append("".join(lines[start - 1: node.end_lineno]))
    missing = wanted - found
    if missing:
        raise KeyError(f"not defined at the top of the upstream file: {sorted(missing)}")
    return "\n\n".join(parts) + "\n"


def load_defs(path: str, names: Iterable[str], prelude: str = "") -> ModuleType:
    """A private module holding `prelude` + upstream's named top-level definitions, verbatim."""
    names = tuple(names)
    text, origin = source_of(path)
    body = extract_defs(text, names)
    src = f"# extracted at run time from {origin}: {', '.join(names)}\n{prelude}\n\n{body}"
    return _import_text(src, f"defs:{path}:{names}:{hashlib.sha256(prelude.encode()).hexdigest()}", origin)


INDEXER_DEFS = ("_arange_cache", "fp8_paged_mqa_logits_torch_sm120", "topk_transform_512_pytorch_vectorized")
INDEXER_PRELUDE = (
    "from typing import Any, Optional\n\n"
    "import torch\nimport torch.nn.functional as F\n\n"
    "FP8_DTYPE = torch.float8_e4m3fn  # upstream's non-HIP branch\n"
)


def load_indexer() -> ModuleType:
    """Upstream's sm_120 torch indexer logits and its torch top-k (`dsv4/indexer.py`), verbatim."""
    return load_defs(INDEXER_PATH, INDEXER_DEFS, INDEXER_PRELUDE)


def extract_methods(text: str, cls: str, names: Iterable[str]) -> str:
    """The named methods of top-level class `cls`, dedented to module-level functions taking `self`.

    Raises KeyError naming what is missing, so a renamed upstream method fails loudly.
    """
    wanted = set(names)
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise KeyError(f"class {cls} not defined at the top of the upstream file")
    parts, found = [], set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name in wanted:
            found.add(item.name)
            start = min([item.lineno] + [d.lineno for d in item.decorator_list])
            parts.append(textwrap.dedent("".join(lines[start - 1: item.end_lineno])))
    missing = wanted - found
    if missing:
        raise KeyError(f"not defined in upstream class {cls}: {sorted(missing)}")
    return "\n\n".join(parts) + "\n"


MHC_PATH = "sglang/srt/layers/mhc.py"
DSV4_MODEL_PATH = "sglang/srt/models/deepseek_v4.py"
MHC_DEFS = ("pass_configs", "FP8", "BF16", "FP32", "INT32", "hc_split_sinkhorn_kernel", "hc_split_sinkhorn",
            "mhc_post_tilelang", "mhc_post")
# The four sglang helpers mhc.py imports, as the pinned code defines them for a CUDA, no-context-parallel run.
MHC_PRELUDE = '''
import functools
import math
from typing import Tuple

import tilelang
import tilelang.language as T
import torch

tilelang.set_log_level("WARNING")


def is_arch_support_pdl() -> bool:  # sglang.jit_kernel.utils: CUDA arch major >= 9
    return torch.cuda.get_device_capability()[0] >= 9


def is_dsa_prefill_cp_round_robin_split() -> bool:  # DSA prefill context parallelism is off
    return False


def strict_contiguous(x):  # sglang.srt.layers.utils.common (only reached under context parallelism)
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
'''


def load_mhc() -> ModuleType:
    """Upstream's TileLang mHC kernels (`layers/mhc.py`: Sinkhorn split, post), verbatim; needs tilelang.

    Registered in sys.modules under its private name so the decoder-layer methods below can import it.
    """
    mod = load_defs(MHC_PATH, MHC_DEFS, MHC_PRELUDE)
    import sys

    sys.modules.setdefault(mod.__name__, mod)
    return mod


# What `server_args.py` sets for DeepseekV4 on sm_120 (TileLang pre and DeepGEMM hc-prenorm off; TileLang
# post keeps its default, on), and `compile_in_capture_mode` as it behaves while SGLang captures graphs.
_DSV4_PRELUDE = '''
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Flag:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class envs:
    SGLANG_OPT_USE_TILELANG_MHC_PRE = _Flag(False)
    SGLANG_OPT_DEEPGEMM_HC_PRENORM = _Flag(False)
    SGLANG_OPT_USE_TILELANG_MHC_POST = _Flag(True)
    SGLANG_OPT_USE_AITER_MHC_PRE = _Flag(False)
    SGLANG_OPT_USE_AITER_MHC_POST = _Flag(False)


_is_hip = False


def compile_in_capture_mode(func):  # model_executor/cuda_graph_runner.py, in capture mode
    return torch.compile(func)
'''


def load_dsv4_mhc_methods() -> ModuleType:
    """`DeepseekV4DecoderLayer.hc_pre` / `hc_post` of the pinned model as functions of `self`, verbatim
    but for their `from sglang.srt.layers.mhc import ...` lines, which import `load_mhc()`'s module."""
    mhc = load_mhc()
    text, origin = source_of(DSV4_MODEL_PATH)
    body = extract_defs(text, ["_MHC_POST_MULT_VALUE"]) + "\n" + extract_methods(
        text, "DeepseekV4DecoderLayer", ["hc_pre", "hc_post"])
    body = body.replace("from sglang.srt.layers.mhc import", f"from {mhc.__name__} import")
    src = f"# extracted at run time from {origin}: DeepseekV4DecoderLayer.hc_pre/hc_post\n{_DSV4_PRELUDE}\n\n{body}"
    return _import_text(src, f"methods:{DSV4_MODEL_PATH}:hc_pre,hc_post", origin)
