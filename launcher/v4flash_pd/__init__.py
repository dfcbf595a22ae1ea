"""v4flash-pd: one pinned SGLang stack, one image, one command for DeepSeek-V4-Flash PD serving."""

__version__ = "0.1.0"
