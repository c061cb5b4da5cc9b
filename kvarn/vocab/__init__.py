"""Torch-free descriptions everything else reads: KV type facts, the tail policy, a cell's run options,
a model's cache geometry."""
