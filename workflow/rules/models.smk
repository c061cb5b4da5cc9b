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
    run:
        from kvarn.models import ModelSpec

        spec = ModelSpec(wildcards.model, params.source, params.revision)
        fetch_model_marker(output.marker, spec, log[0])
