"""Rule retrieval_tasks: one (model, context, task) set of prompts (kvarn.retrieval.tasks) -> tasks.jsonl, atomically."""

from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.retrieval import run, tasks

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output
tokenizer, bos_id = run.load_tokenizer(model_spec(snakemake), Path(snakemake.input.model).parent)
records = tasks.make_tasks(tokenizer, bos_id, w.task, int(w.n_ctx), p.spec["depths"], p.spec["prompts"],
                           seed=p.spec["seed"], gen_tokens=p.spec["gen_tokens"])
tasks.write_tasks(out.tasks, records)
print(f"{len(records)} prompts of {records[0]['n_prompt']} tokens -> {out.tasks}")
