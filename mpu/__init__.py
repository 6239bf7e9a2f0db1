"""The tensor-parallel core: the device mesh and its process groups (`mesh`), every collective
as a named function (`mappings`: autograd collectives with their conjugate backward, and the
non-differentiable ones code above calls; `shm_collectives`: CPU collectives through shared
memory on one host; `waits`: labelled waits named in hang reports), the tensor-parallel
layers, vocab-parallel cross-entropy, RNG tracking, recomputation, layout-independent init,
and context parallelism (`attention_blocks`, `context_parallel`: attention over a sequence
split across `mesh.cp`).

The pipeline lives in `meshtron.pipeline`, data-parallel gradient reduction and the
optimizers in `meshtron.dp`; both import this package, never the other way round."""
