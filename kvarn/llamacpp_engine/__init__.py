"""The study's own program as an engine: a llama.cpp build runs the baseline and the cells (kvarn.llamacpp_engine.runner)."""
