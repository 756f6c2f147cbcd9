"""kernels: compute ops for the policy.

- kernels.kda: Kimi Delta Attention (chunked / recurrent torch paths, fla-core dispatch on CUDA), gates.
- kernels.ops: reference paths for the other ops (norms, SiTU-GLU, short conv, masked attention).
- kernels.mx: MXFP4 / MXFP8 quantise and dequantise (OCP Microscaling).
"""
