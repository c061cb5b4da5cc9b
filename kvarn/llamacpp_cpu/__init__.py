"""llama.cpp's side: its CPU attention and activation arithmetic as a compute path (DESIGN §6b), and
llama-perplexity's `--kl-divergence-base` file."""
