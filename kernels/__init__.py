"""Fused Triton kernels (norms, linear+activation, cross-entropy, grouped GEMM), each beside its
plain-torch reference of the same signature, the backend choice (`backend`, `selfcheck`),
per-device configs, TF32 policy and the ahead-of-time compile check (`aot`).

Imported as `meshtron.kernels`. A plain `import kernels` run where this checkout is on
`sys.path` gets Hugging Face's installed `kernels` package instead (transformers imports it):
meshtron/shadowing.py."""

if __name__ == "kernels":
    from meshtron.shadowing import import_installed_instead

    import_installed_instead(__name__, __file__)
