rule baseline:
    wildcard_constraints:
        model=TORCH_MODELS,
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),  # sha256-fixed: its identity cannot change
    output:
        f"{RUN}/baseline{{bopts}}.kvd",  # bopts: kvarn.vocab.cell.compute_suffix of the compute path
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


# A model of the llama.cpp engine (kvarn.llamacpp_engine.runner): the build's own bf16-cache run writes
# llama-perplexity's KLD base file, and its identity beside it.
rule baseline_program:
    wildcard_constraints:
        model=PROGRAM_MODELS,
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),
    output:
        base=f"{RUN}/{kvp.PROGRAM_BASELINE}",
        identity=f"{RUN}/{kvp.PROGRAM_BASELINE}.json",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        engine=engine_param,
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{LOG}/baseline.llama.log",
    benchmark:
        f"{BENCH}/baseline.llama.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/program.py"
