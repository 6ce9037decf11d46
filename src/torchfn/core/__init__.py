"""The foundation every other subpackage builds on.

- ``tree``: pytrees on optree (public as ``torchfn.tree``).
- ``random``: explicit counter-based PRNG keys (public as ``torchfn.random``).
- ``module``: ``Model``, any ``nn.Module`` as pure ``init`` / ``apply``.
- ``checkpoint``: ``save`` / ``load`` of whole pytrees as one safetensors file.
- ``scan``: a carry-threading loop with stacked outputs (``jax.lax.scan``).
- ``segment``: ``segment_sum`` / ``segment_max`` / ``segment_softmax`` (``jax.ops``,
  jraph): reductions over rows sharing an id, for message passing on edge lists.
- ``remat``: recompute activations in the backward, under ``torch.func`` too.

Nothing is imported here, so importing one piece stays cheap; use the flat
names on ``torchfn`` (``torchfn.Model``, ``torchfn.save``, ...).
"""
