"""autosac where people train: one line in each trainer.

- :mod:`autosac.trainers.hf`: ``AutosacCallback`` for transformers' ``Trainer``
  (extra ``autosac[hf]``);
- :mod:`autosac.trainers.lightning`: ``AutosacCallback`` for ``lightning.Trainer``
  (extra ``autosac[lightning]``);
- :mod:`autosac.trainers.titan`: ``AutosacAC``, an activation-checkpointing
  config for torchtitan (extra ``autosac[titan]``).

Each module imports its trainer when it is imported, and says which extra to
install when that trainer is missing.
"""
