rule baseline:
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),  # sha256-fixed: its identity cannot change
    output:
        f"{RUN}/baseline{{bopts}}.kvd",  # bopts: kvarn.plan.matrix.compute_suffix of the compute path
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        compute=lambda wildcards: kvm.parse_opts(wildcards.bopts)["compute"],
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{LOG}/baseline{{bopts}}.log",
    benchmark:
        f"{BENCH}/baseline{{bopts}}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/baseline.py"
