"""Rule report_page: the answer, the claims ledger, the figures (and the retrieval and per-layer
results found at planning time) -> results/report.html, one self-contained page (kvarn.report.page)."""

from _wf import start

start(snakemake)
from kvarn.report.page import write_page

out = write_page(
    snakemake.output.html,
    summary=snakemake.input.summary,
    answer_md=snakemake.input.answer_md,
    answer=snakemake.input.answer,
    claims=snakemake.input.claims,
    decisions=list(snakemake.input.decisions),
    figures=list(snakemake.input.figures),
    found=list(snakemake.params.found),
)
print(f"wrote {out} ({out.stat().st_size} bytes); optional results shown: {sorted(snakemake.params.found) or 'none'}")
