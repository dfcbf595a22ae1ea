"""The ground floor every op folder and every bench shares (imports nothing else of v4flash_kernels).

`device`: per-device buffers and facts (zeroed arrival counters, the SM count); `compare`: `rel_err`;
`fp8`: the block-FP8 format's quantization and dequantization from its definition; `measure`: the
CUDA-graph timers and the copy bandwidth; `table`: the one text/markdown table formatter.
"""
