"""Fused Triton kernels (norms, linear+activation, cross-entropy, grouped GEMM), each beside its
plain-torch reference of the same signature, the backend choice (`backend`, `selfcheck`),
per-device configs, TF32 policy and the ahead-of-time compile check (`aot`)."""
