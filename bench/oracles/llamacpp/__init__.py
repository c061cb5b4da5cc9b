"""llama.cpp as the oracle: llama-perplexity, ggml's flash attention, its converter (bench/oracles/llamacpp/README.md)."""
