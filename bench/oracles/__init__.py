"""External programs as oracles for kvarn's numbers: llama.cpp, BeeLlama (bench/README.md)."""
