# Paired statistics of the run each model's table shows (kvarn.report.paired_table.run_table): every
# cell's median KLD interval, Δ median vs the standard floor, KVarN vs the same-width
# standard type, all from a seeded circular block bootstrap over the cells' tokens.parquet.
# They feed the table's `band` column and the ranked figure (rule report_figures).
#
# Uses from common.smk: token_parquets(model); from report.smk: kvr.
# Optional config: report: {boot: 2000, seed: 0}.


rule paired:
    input:
        summary="results/summary.parquet",
        tokens=lambda wildcards: kvr.report_run_tokens(token_parquets(wildcards.model)),
    output:
        "results/paired/{model}.parquet",
    params:
        boot=kvr.option(config, "boot"),
        seed=kvr.option(config, "seed"),
        tail=kvr.option(config, "tail"),
    log:
        "logs/report/{model}/paired.log",
    benchmark:
        "benchmarks/report/{model}/paired.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/paired.py"
