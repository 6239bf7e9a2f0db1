"""Mixture of Experts: layer config and rules (`config`), top-k router with balancing losses
(`router`, `scope`), capacity, the all-to-all token dispatcher over the ep group, grouped-GEMM
experts and the MoE layer that ties them together (`layer`)."""
