"""The SGLang import hook: the interpreter-start finder, the patch registry, the patching, adapters.

Must stay import-free: the wheel's .pth imports `hook_boot` from here in every interpreter.
"""
