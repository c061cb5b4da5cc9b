# The cells of the matrix (kvarn.plan.matrix): one job per cell path, and its table row.
#
# Per-layer allocations (kvarn.vocab.allocation): their definitions are written where the cell jobs,
# and the workers they start, look them up by the token in the cell's path (content-addressed, so a
# worker started before an edit never reads a stale one); a cell's `versions` param holds the
# numerics version of its K and V types and, for an allocation, of every type it uses
# (kvarn.plan.allocations.allocation_versions: bumping one reruns the cells using it).
kva.publish_allocations(MATRIX.allocations.values())


rule cell:
    wildcard_constraints:
        model=TORCH_MODELS,
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),  # sha256-fixed: its identity cannot change
        baseline=cell_baseline,
    output:
        summary=f"{CELL}/summary.json",
        tokens=f"{CELL}/tokens.parquet",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        cell=cell_fields,
        versions=lambda wildcards: {**format_versions(wildcards),
                                    **kva.allocation_versions(kvm.CellSpec.from_wildcards(wildcards))},
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{LOG}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.log",
    benchmark:
        f"{BENCH}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/cell.py"


# A cell of a llama.cpp-engine model (kvarn.llamacpp_engine.runner): the same files, from the program's logits.
rule cell_program:
    wildcard_constraints:
        model=PROGRAM_MODELS,
    input:
        model=model_marker,
        text=ancient(rules.wikitext.output[0]),
        baseline=cell_baseline,
        identity=lambda wildcards: cell_baseline(wildcards) + ".json",
    output:
        summary=f"{CELL}/summary.json",
        tokens=f"{CELL}/tokens.parquet",
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        cell=cell_fields,
        engine=engine_param,
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{LOG}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.log",
    benchmark:
        f"{BENCH}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/program.py"


rule cell_row:
    input:
        f"{CELL}/summary.json",
    output:
        f"{CELL}/row.parquet",
    params:
        columns=cell_columns,
    log:
        f"{LOG}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.row.log",
    benchmark:
        f"{BENCH}/cells/{{k}}-{{v}}-t{{tail}}{{opts}}.row.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/cell_row.py"
