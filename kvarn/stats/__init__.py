"""Statistics: per-token KLD metrics with llama-perplexity's summaries, and paired comparisons between cells."""
