# Which layers deserve the bits (kvarn.perlayer; docs/notes/per-layer.md). With a `perlayer:` key
# (config/perlayer.yaml), per torch model: each type's one-layer sensitivities on Wikitext-2 valid,
# per budget the searched allocations (a checkpoint: the cells it picks are known once it has run),
# those allocations run as cells of the model's first run on the test text (rule cell), and the
# held-out table. Not part of rule all:
#   snakemake perlayer --configfile config/matrix.yaml config/perlayer.yaml --cores all --resources gpu=1
#
#   results/perlayer/{model}/sensitivity/{type}.parquet   one row per (attention layer, K or V)
#   results/perlayer/{model}/search/{budget}.json         the allocations, their bytes, the first/last tries
#   results/perlayer/perlayer.{md,parquet}, figures/{model}-sensitivity.{svg,png,vl.json}
#
# Uses from common.smk: PERLAYER, MATRIX, TORCH_MODELS, MODEL_THREADS, model_marker, model_param, and the
# per-layer helpers perlayer_plan, perlayer_run, perlayer_cells, perlayer_searches, perlayer_heatmaps,
# perlayer_targets.
PERLAYER_LOG = "logs/perlayer/{model}"


rule perlayer:
    input:
        # the searches named here too: a new budget's search is a missing file, planned even where the table
        # is up to date (snakemake does not look past an up-to-date output into an incomplete checkpoint)
        lambda wildcards: [*perlayer_searches(), *perlayer_targets()],


rule wikitext_valid:
    output:
        kvpl.SEARCH_TEXT,
    log:
        "logs/wikitext_valid.log",
    run:
        # as rule wikitext: where to read it is not what it is (the sha256 fixes that)
        copy_wikitext(perlayer_plan().text, output[0], log[0], split="validation")


rule perlayer_sensitivity:
    wildcard_constraints:
        model=TORCH_MODELS,
        type=kvp.TYPE_PATTERN,
    input:
        model=model_marker,
        text=ancient(kvpl.SEARCH_TEXT),
    output:
        kvpl.SENSITIVITY_FILE,
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        search=lambda wildcards: {"n_ctx": perlayer_plan().n_ctx, "chunks": perlayer_plan().chunks,
                                  "tail": perlayer_plan().tail_of(wildcards.type),
                                  "version": kvrows.format_version(wildcards.type)},
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{PERLAYER_LOG}/sensitivity/{{type}}.log",
    benchmark:
        "benchmarks/perlayer/{model}/sensitivity/{type}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/perlayer_sensitivity.py"


checkpoint perlayer_search:
    wildcard_constraints:
        model=TORCH_MODELS,
        budget=kvp.TYPE_PATTERN,
    input:
        model=model_marker,
        text=ancient(kvpl.SEARCH_TEXT),
        sensitivity=lambda wildcards: perlayer_plan().sensitivity_files(wildcards.model),
    output:
        kvpl.SEARCH_FILE,
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        accounting=model_param("memory_accounting"),
        eval_n_ctx=lambda wildcards: perlayer_run(wildcards.model)[0],
        plan=lambda wildcards: {**vars(perlayer_plan()), "budgets": None},  # a budget's job: not the others'
    threads: MODEL_THREADS
    resources:
        gpu=1,
    log:
        f"{PERLAYER_LOG}/search/{{budget}}.log",
    benchmark:
        "benchmarks/perlayer/{model}/search/{budget}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/perlayer_search.py"


rule perlayer_table:
    input:
        summary="results/summary.parquet",
        searches=lambda wildcards: perlayer_searches(),
        sensitivity=lambda wildcards: [p for m, mm in MATRIX.models.items() if mm.engine == "torch"
                                       for p in perlayer_plan().sensitivity_files(m)],
        tokens=lambda wildcards: [f"{c.dir}/tokens.parquet" for c in MATRIX.cells if c.engine == "torch"]
        + [f"{d}/tokens.parquet" for m, mm in MATRIX.models.items() if mm.engine == "torch"
           for d in perlayer_cells(m)],
    output:
        **kvpl.TABLE_FILES,
        figures=perlayer_heatmaps() if PERLAYER else [],
    params:
        boot=kvr.option(config, "boot"),
        seed=kvr.option(config, "seed"),
        # a new budget changes it, so the table is planned again, and through its inputs the new search
        # (a checkpoint: with the table's output up to date, snakemake would not look past it)
        budgets=lambda wildcards: list(perlayer_plan().budgets),
    log:
        "logs/perlayer/table.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/perlayer_table.py"
