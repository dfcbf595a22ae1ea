"""DeepSeek-V4 compressor at decode (sm_120 drop-in for compressor_v2's forward_unified): one Triton
kernel for the wkv_gate GEMV, the state ring, the window pooling, RMSNorm + RoPE (+ Hadamard) and the
FP8 paged-cache store; its host side, fp64 reference and self-check.
"""
