"""Rule retrieval_report: every answer file -> the scores, the comparisons, the Markdown,
the paragraph and the figure (kvarn.retrieval.report.write_report)."""

from _wf import start

start(snakemake)  # noqa: F821
from kvarn.retrieval import report  # noqa: E402

paths = report.write_report(list(snakemake.input.answers), dict(snakemake.output.items()),  # noqa: F821
                            teacher_forced=snakemake.params.teacher_forced,  # noqa: F821
                            bins=snakemake.params.bins)  # noqa: F821
print("\n".join(map(str, paths)))
