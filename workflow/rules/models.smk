rule fetch_model:
    output:
        marker=f"{config['model_cache']}/{{model}}.{{source_key}}.fetched.json",
    log:
        "logs/{model}/fetch_model.{source_key}.log",
    benchmark:
        "benchmarks/{model}/fetch_model.{source_key}.tsv"
    run:
        fetch_model_marker(output.marker, wildcards.model, wildcards.source_key, log[0])
