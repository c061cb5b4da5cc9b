rule baseline:
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),  # sha256-fixed: its identity cannot change
    output:
        f"{RUN}/baseline.kvd",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
    resources:
        gpu=1,
    log:
        f"{LOG}/baseline.log",
    benchmark:
        f"{BENCH}/baseline.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/baseline.py"
