"""kernels: compute ops for the policy.

- kernels.kda: Kimi Delta Attention (chunked / recurrent torch paths, fla-core dispatch on CUDA), gates.
- kernels.attention: softmax attention for the global layers (PyTorch SDPA on CUDA, reference elsewhere).
- kernels.ops: reference paths for the other ops (norms, SiTU-GLU, short conv, masked attention,
  DSA top-k selection).
- kernels.fusion: torch.compile'd copies of the fp32 elementwise chains, used for CUDA inputs.
- kernels.mx: MXFP4 / MXFP8 quantise and dequantise (OCP Microscaling).
"""
