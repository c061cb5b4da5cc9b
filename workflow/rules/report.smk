# Tables and figures of every model, from results/summary.parquet (and, for the position
# and distribution figures, a few cells' tokens.parquet). The drawing is kvarn.report;
# the scripts are thin adapters. How to read each output: docs/notes/report.md.
#
# Uses from common.smk: model_names(), token_parquets(model); rule report_page also decode_targets()
# where the including Snakefile has it (a decoding model's figure joins its page).
# Optional config (kvarn.report.workflow.DEFAULTS; the schema must allow a `report` section):
#   report: {cells: ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0"], widths: [2, 4, 8], tail: 128, position_bins: 24}
#   cells: the cells the per-token figures draw (cell directory names); default: the
#   standard qN_0-qN_0 at `tail` and kvarnN-kvarnN (128*) for N in `widths`.
from kvarn.report import workflow as kvr

# Every table and figure path of every model (rule all's input, through all_targets()).
report_targets = lambda: kvr.targets(model_names())
figure_tokens = lambda wildcards: kvr.figure_tokens(token_parquets(wildcards.model), config)
figure_outputs = kvr.figure_outputs
page_figures = lambda: kvr.page_figures(
    model_names(), decode_targets() if "decode_targets" in globals() else ()
)


# The answer a user came for (kvarn.report.advise; `kvarn advise` prints the same with a tolerance of
# one's own): per model the frontier with its bands, the cheapest cell within the default tolerance,
# the presets. Optional config: report: {boot: 2000, seed: 0}.
rule answer:
    input:
        summary="results/summary.parquet",
        tokens=lambda wildcards: [p for m in model_names() for p in kvr.report_run_tokens(token_parquets(m))],
    output:
        **kvr.ANSWER_OUTPUTS,
    params:
        boot=kvr.option(config, "boot"),
        seed=kvr.option(config, "seed"),
    log:
        "logs/report/answer.log",
    benchmark:
        "benchmarks/report/answer.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/answer.py"


# The study's claims as a ledger (kvarn.report.claims), with the paired intervals from the
# tokens of the cells each model's tables show, and each model's decision tables. Optional
# config: report: {study_model: {MODEL: qwen3.6-27b | gemma4-31b}} (default: config/study.yaml).
rule claims:
    input:
        summary="results/summary.parquet",
        study="config/study.yaml",
        tokens=lambda wildcards: [p for m in model_names() for p in kvr.report_run_tokens(token_parquets(m))],
    output:
        md=kvr.CLAIMS_OUTPUTS["md"],
        parquet=kvr.CLAIMS_OUTPUTS["parquet"],
        html=report(
            kvr.CLAIMS_OUTPUTS["html"],
            caption="../report/claims.rst",
            category=kvr.CLAIMS_CATEGORY,
            subcategory="ledger and decision tables",
            labels={"figure": "claims ledger"},
        ),
        decisions=kvr.decision_tables(model_names()),
    params:
        study_models=kvr.option(config, "study_model"),
        boot=kvr.option(config, "boot"),
        seed=kvr.option(config, "seed"),
    log:
        "logs/report/claims.log",
    benchmark:
        "benchmarks/report/claims.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/claims.py"


rule report_table:
    input:
        summary="results/summary.parquet",
        paired="results/paired/{model}.parquet",
    output:
        md="results/tables/{model}.md",
        html=report(
            "results/tables/{model}.html",
            caption="../report/table.rst",
            category="{model}",
            subcategory="table",
            labels={"model": "{model}", "figure": "table"},
        ),
        parquet="results/tables/{model}.parquet",
    log:
        "logs/report/{model}/table.log",
    benchmark:
        "benchmarks/report/{model}/table.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/tables.py"


# Every figure of one model in one job (kvarn.report.workflow.MODEL_FIGURES): the summary
# figures, the per-token figures of the chosen cells, the ranked intervals (rule paired) and
# the llama.cpp kernel share; each svg in the report with workflow/report/{figure}.rst.
rule report_figures:
    input:
        summary="results/summary.parquet",
        paired="results/paired/{model}.parquet",
        tokens=figure_tokens,
    output:
        **figure_outputs(kvr.MODEL_FIGURES),
    params:
        figures=kvr.MODEL_FIGURES,
        options=kvr.figure_options(config),
    log:
        "logs/report/{model}/figures.log",
    benchmark:
        "benchmarks/report/{model}/figures.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/figures.py"


# The landing page, results/report.html (kvarn.report.page; `make report` copies it to report.html): the
# answer first, then the claims ledger and decision tables, then every model's figures with their captions
# (placeholders left out, named), then the retrieval and per-layer results where they exist. One
# self-contained file: inline CSS, the figures as SVG data URIs, no script. The optional results are found
# at planning time (kvr.page_found: path -> mtime), a param, so the page is rebuilt when one appears or
# changes without their own rules being asked to run.
rule report_page:
    input:
        summary="results/summary.parquet",
        answer_md=kvr.ANSWER_OUTPUTS["md"],
        answer=kvr.ANSWER_OUTPUTS["parquet"],
        claims=kvr.CLAIMS_OUTPUTS["parquet"],
        decisions=lambda wildcards: kvr.decision_tables(model_names()),
        figures=lambda wildcards: page_figures(),
    output:
        html=kvr.PAGE,
    params:
        found=lambda wildcards: kvr.page_found(),
    log:
        "logs/report/page.log",
    benchmark:
        "benchmarks/report/page.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/page.py"
