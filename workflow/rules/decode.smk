# Free-running decode divergence (kvarn.decode): per (cell, decode) a cached result,
#   results/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}/{k}-{v}-t{tail}{opts}/{steps.parquet,summary.json}
# for the models whose config has `decode: {prompts: P, tokens: G, cells: [...]}`, and one
# figure per such model (survival curves and KLD per decode step).
#
# Uses from common.smk: MATRIX, decode_targets (rule all), model_marker, model_param, cell_opt, format_version;
# from report.smk: figure_outputs.
DECODE = kvm.DECODE_DIR
DECODE_LOG = "logs/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}/{k}-{v}-t{tail}{opts}"
DECODE_BENCH = "benchmarks/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}/{k}-{v}-t{tail}{opts}"


rule decode:
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),  # sha256-fixed: its identity cannot change
    output:
        steps=f"{DECODE}/steps.parquet",
        summary=f"{DECODE}/summary.json",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        rot=cell_opt("rot"),
        tail_dtype=cell_opt("tail_dtype"),
        iters=cell_opt("iters"),
        sink=cell_opt("sink"),
        k_version=format_version("k"),
        v_version=format_version("v"),
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{DECODE_LOG}.log",
    benchmark:
        f"{DECODE_BENCH}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/decode.py"


rule report_decode:
    input:
        decode=lambda wildcards: [f"{d}/summary.json" for d in MATRIX.decode_dirs(wildcards.model)],
    output:
        **figure_outputs("decode"),
    params:
        figure="decode",
        options={},
    log:
        "logs/report/{model}/decode.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/figures.py"
