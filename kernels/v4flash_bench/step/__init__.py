"""One DeepSeek-V4-Flash decode step (and prefill chunk) of one TP4 GPU, op by op (`python -m v4flash_bench.step`).

`model` is the pure plan (ops, shapes, layer counts, floors, composition); `ops` builds each op on
a GPU from the pinned wheel's code or our patches; `runner` checks and times them; `results` holds
the measurements and maps them onto the two paths (torch-free); `report` formats.
"""
