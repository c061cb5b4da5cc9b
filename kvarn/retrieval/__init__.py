"""Long-context retrieval through a quantized cache (docs/notes/retrieval.md).

Does a quantized KV cache lose a fact stated thousands of tokens earlier? The teacher-forced KLD
keeps the newest 128 tokens exact for every scored position, so it says little about that. This
package asks it directly, on seeded synthetic tasks, through the same cell and cache model as every
teacher-forced cell:

* `tasks`  — the seeded task generator (pass key, several keys, key–value lookup; RULER's needle, multi-key,
  multi-value, multi-query and variable-tracking families in filler or Wikitext-2) and its JSONL files;
* `plan`   — the `retrieval:` config key read into jobs and target paths (torch-free, for snakemake -n);
* `run`    — one cell's greedy answers to a task set (`kvarn.run.forward.new_cache`, `kvarn.run.decode.feed`);
* `score`  — accuracy, agreement with the exact cache, flips, Wilson intervals, exact McNemar and Wilcoxon tests, Holm;
* `report` — the tables, the figures (by distance; the length × depth heatmap) and the generated paragraph
  beside the teacher-forced ordering.
"""
