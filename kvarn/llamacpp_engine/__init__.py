"""The study's own program as an engine: a llama.cpp build runs the baseline and the cells (kvarn.program.runner)."""
