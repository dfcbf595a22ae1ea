"""load_config: every layer, checked and laid out, in one call (the CLI edge and tests start here).

The chain runs one way: `layers` merges the raw dicts, `build` checks them into a Config, and only
then `layout` places a cluster's slots; none of them imports the one after it.
"""

from __future__ import annotations

from typing import Any

from v4flash_pd.config.build import build_config
from v4flash_pd.config.layers import Layers, merged_layers
from v4flash_pd.config.layout import expand
from v4flash_pd.config.types import Config


def config_of(layers: Layers) -> Config:
    """Merged layers -> the validated Config, a cluster's slots laid out."""
    return expand(build_config(*layers))


def load_config(*args: Any, **kwargs: Any) -> Config:
    """Resolve all layers into a validated Config (the arguments are `layers.merged_layers`'s)."""
    return config_of(merged_layers(*args, **kwargs))
