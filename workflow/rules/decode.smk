# Free-running decode divergence (kvarn.run.decode): per (cell, decode) a cached result,
#   results/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/{k}-{v}-t{tail}{opts}/{steps.parquet,summary.json}
# for the models whose config has `decode: {prompts: P, tokens: G, cells: [...]}` (and optionally
# temperature T and seed S: a sampled decode, {sampling} = "-T{T}-s{S}"; "" greedy), and one
# figure per such model (survival curves and KLD per decode step).
#
# Uses from common.smk: MATRIX, decode_targets (rule all), model_marker, model_param, cell_fields, format_versions;
# from report.smk: figure_outputs, kvr (kvr.generation_figure_outputs).
from kvarn.plan import generation as kvgen
from kvarn.vocab.options import DECODE_VERSION

DECODE = kvp.DECODE_DIR
GENERATION = f"{kvp.DECODE_RUN_DIR}/{kvgen.GENERATION_DIR}"
DECODE_LOG = "logs/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/{k}-{v}-t{tail}{opts}"
DECODE_BENCH = "benchmarks/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/{k}-{v}-t{tail}{opts}"


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
        cell=cell_fields,
        versions=format_versions,
        decode_version=DECODE_VERSION,  # the decode's arithmetic: a bump reruns every decode
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
        **figure_outputs(["decode"]),
    params:
        figures=["decode"],
        options={"decode": {}},
    log:
        "logs/report/{model}/decode.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/figures.py"


# Long generation (config/generation.yaml; docs/notes/decode.md "Long generation"): per decode
# run, the statistics of kvarn.report.generation from its (cell, decode) results and the same
# cells' teacher-forced tokens, then four figures. Not part of rule all: run the target
#   snakemake generation --cores 2 --resources gpu=1 --configfile config/generation.yaml
rule generation:
    input:
        lambda wildcards: kvgen.targets(MATRIX),


rule generation_stats:
    input:
        unpack(lambda wildcards: kvgen.run_inputs(MATRIX, wildcards.model, wildcards.n_ctx, wildcards.prompts,
                                                  wildcards.tokens, wildcards.sampling)),
    output:
        cells=f"{GENERATION}/cells.parquet",
        paired=f"{GENERATION}/paired.parquet",
        survival=f"{GENERATION}/survival.parquet",
        curves=f"{GENERATION}/curves.parquet",
        md=f"{GENERATION}/generation.md",
    params:
        boot=kvr.option(config, "boot"),
        seed=kvr.option(config, "seed"),
    log:
        "logs/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/generation.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/generation.py"


rule report_generation:
    input:
        cells=f"{GENERATION}/cells.parquet",
        paired=f"{GENERATION}/paired.parquet",
        survival=f"{GENERATION}/survival.parquet",
        curves=f"{GENERATION}/curves.parquet",
    output:
        **kvr.generation_figure_outputs(),
    log:
        "logs/report/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/figures.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/generation_figures.py"
