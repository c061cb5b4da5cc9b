rule summary:
    input:
        # with a perlayer: key, the searched allocations' cells too (workflow/rules/perlayer.smk)
        lambda wildcards: [f"{c.dir}/row.parquet" for c in MATRIX.cells]
        + ([f"{d}/row.parquet" for m, mm in MATRIX.models.items() if mm.engine == "torch" for d in perlayer_cells(m)]
           if PERLAYER is not None else []),
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
