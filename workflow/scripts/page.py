"""Rule report_page: the answer, the claims ledger, the figures (and the retrieval and per-layer
results found at planning time) -> results/report.html, one self-contained page (kvarn.report.page)."""

from _wf import start

start(snakemake)
from kvarn.report.page import write_page

sm = snakemake
out = write_page(sm.output.html, summary=sm.input.summary, answer_md=sm.input.answer_md, answer=sm.input.answer,
                 claims=sm.input.claims, decisions=list(sm.input.decisions), figures=list(sm.input.figures),
                 found=list(sm.params.found))
print(f"wrote {out} ({out.stat().st_size} bytes); optional results shown: {sorted(sm.params.found) or 'none'}")
