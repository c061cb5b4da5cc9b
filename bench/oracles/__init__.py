"""External programs as oracles for kvarn's numbers: llama.cpp, BeeLlama (bench/oracles/README.md)."""
