"""kimi_kernels: compute ops for the policy (not `kernels`: that import name is Hugging Face's kernel hub
package, which transformers 5.25+ depends on and imports).

- kimi_kernels.kda: Kimi Delta Attention (chunked / recurrent torch paths, fla-core dispatch on CUDA), gates.
- kimi_kernels.attention: softmax attention for the global layers (PyTorch SDPA on CUDA, reference elsewhere).
- kimi_kernels.ops: reference paths for the other ops (norms, SiTU-GLU, short conv, masked attention,
  DSA top-k selection).
- kimi_kernels.fusion: torch.compile'd copies of the fp32 elementwise chains, used for CUDA inputs.
- kimi_kernels.mx: MXFP4 / MXFP8 quantise and dequantise (OCP Microscaling).
"""
