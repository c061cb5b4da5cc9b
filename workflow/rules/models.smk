rule fetch_model:
    output:
        marker=f"{config['model_cache']}/{{model}}.fetched.json",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
    log:
        "logs/{model}/fetch_model.log",
    benchmark:
        "benchmarks/{model}/fetch_model.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/fetch_model.py"
