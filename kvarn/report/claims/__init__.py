"""The study's claims as a computed ledger, and its decision tables (docs/notes/report.md).

* `study`       — the study's printed figures (config/study.yaml)
* `verdicts`    — a ledger row's columns, its verdict and the paired Δ median
* `decisions`   — the rows the study read and its decision tables
* `definitions` — one function per claim
* `ledger`      — every claim's rows, per model and for a whole run
* `render`      — the ledger and the tables as Markdown and HTML
"""
