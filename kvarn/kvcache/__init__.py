"""The cache model inside transformers (DESIGN §2): the Cache object, its storage rows, and the
attention functions that read exact keys and quantized keys in one softmax (eager and flex)."""
