"""``convert``: a model folder ↔ a Megatron ``torch_dist`` checkpoint, losslessly."""
