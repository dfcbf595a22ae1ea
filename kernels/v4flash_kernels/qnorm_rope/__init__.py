"""DeepSeek-V4's q path after wq_b fused (block-FP8 GEMM + per-head RMSNorm + RoPE, one launch at decode rows):
kernel, op (the `MQALayer._compute_q_b` drop-in), fp64 reference, self-check.
"""
