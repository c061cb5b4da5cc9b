"""Which layers deserve the bits (docs/notes/per-layer.md): per-layer KV types at equal memory.

plan         the `perlayer:` config key: the search text and context, the types, the budgets, paths
sensitivity  the KLD one layer's K (or V) alone adds, per type, on the search text (valid split)
search       per budget, the allocation of least summed sensitivity (multiple-choice knapsack) and
             ik_llama.cpp's first/last form with N chosen on the search text
run          the jobs (workflow/rules/perlayer.smk): the model loaded once, sensitivities and searches written
report       the held-out table (test split, paired against the best uniform pair) and the heatmap
"""
