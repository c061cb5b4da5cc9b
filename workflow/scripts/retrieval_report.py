"""Rule retrieval_report: every answer file -> the scores, the comparisons, the Markdown,
the paragraph and the figure (kvarn.retrieval.report.write_report)."""

from _wf import start

start(snakemake)
from kvarn.retrieval import report

paths = report.write_report(list(snakemake.input.answers), dict(snakemake.output.items()),
                            teacher_forced=snakemake.params.teacher_forced,
                            bins=snakemake.params.bins)
print("\n".join(map(str, paths)))
