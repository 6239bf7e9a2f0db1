"""Data-parallel gradient reduction and the optimizers: bucketed gradient reduction over the
replica groups, overlapped with backward (`grad_reduce`; intra-/inter-node stages in
`hierarchical`), the flat parameter buffers of a bucket (`buckets`), ZeRO-1/2
(`distributed_optimizer`) with parameter all-gathers overlapped with the next forward
(`param_gather`), ZeRO-3 (`zero3`), the optimizer protocol and fused AdamW (`adamw`), gradient
norms and clipping (`grad_norm`), CPU offload (`offload`), 16-bit resident weights
(`resident`) and the parameter server's point-to-point messages (`param_server_comm`).

Built on the tensor-parallel core (`meshtron.mpu`); the model code never imports it."""
