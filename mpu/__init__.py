"""Model-parallel units: the device mesh and its process groups (`mesh`), every collective as a
named function (`mappings`: autograd collectives with their conjugate backward), the
tensor-parallel layers, vocab-parallel cross-entropy, RNG tracking, recomputation,
layout-independent init, data-parallel gradient reduction and ZeRO, the optimizers' fused
update and CPU offload, sharded checkpoint planners, and the pipeline schedules and executor."""
