rule summary:
    input:
        [f"{c.dir}/row.parquet" for c in MATRIX.cells],
    output:
        parquet="results/summary.parquet",
        csv=report(
            "results/summary.csv",
            category="Summary",
            labels={"table": "one row per cell"},
        ),
    log:
        "logs/summary.log",
    benchmark:
        "benchmarks/summary.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/aggregate.py"
