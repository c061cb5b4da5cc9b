# Long-context retrieval through the cache model (kvarn.retrieval; docs/notes/retrieval.md): seeded
# synthetic tasks (a pass key, several keys with one asked for, a key-value lookup; RULER's families)
# at set contexts and depths, answered greedily by every listed cell and by the exact (bf16, tail 0)
# cache. Not part of rule all:
#   snakemake retrieval --configfile config/retrieval.yaml --cores 2 --resources gpu=1
#
#   results/retrieval/{model}/ctx{n_ctx}/{task}/tasks.jsonl                     the prompts (token ids, answer, needle span)
#   results/retrieval/{model}/ctx{n_ctx}/{task}/{k}-{v}-t{tail}{opts}.jsonl     one cell's answers
#   results/retrieval/{scores,comparisons,by_distance,exact_tail,ordering,answers,paired,grid}.parquet,
#   retrieval.md, README-paragraph.md, figures/retrieval.{svg,png,vl.json}, figures/heatmap.{svg,png,vl.json}
#
# Uses from common.smk: MATRIX, MODEL_THREADS, model_marker, model_param.
from kvarn.retrieval import plan as kvret

RETRIEVAL = kvret.expand(config, [n for n, m in MATRIX.models.items() if m.engine == "torch"])
RETRIEVAL_TASKS = list(RETRIEVAL.tasks) if RETRIEVAL else []
RETRIEVAL_LOG = "logs/retrieval/{model}/ctx{n_ctx}"


rule retrieval:
    input:
        lambda wildcards: kvret.targets(RETRIEVAL),


rule retrieval_tasks:
    input:
        model=model_marker,
    output:
        tasks=kvret.TASKS_FILE,
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        spec=lambda wildcards: kvret.require(RETRIEVAL).task_spec(wildcards.model),
        version=kvret.TASK_VERSION,
    log:
        f"{RETRIEVAL_LOG}/{{task}}/tasks.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/retrieval_tasks.py"


rule retrieval_cell:
    input:
        model=model_marker,
        tasks=expand(kvret.TASKS_FILE, task=RETRIEVAL_TASKS, allow_missing=True),
    output:
        answers=expand(kvret.ANSWER_FILE, task=RETRIEVAL_TASKS, allow_missing=True),
    params:
        source=model_param("source"),
        revision=model_param("revision"),
        ubatch=model_param("ubatch"),
        dtype=model_param("dtype"),
        cell=cell_fields,
        versions=format_versions,
    threads: lambda wildcards: (RETRIEVAL.threads if RETRIEVAL and RETRIEVAL.threads else MODEL_THREADS)
    resources:
        # retrieval.hold_gpu false (a CPU run): no `gpu`, so --cores 2 runs two one-thread cell jobs at once
        gpu=1 if RETRIEVAL is None or RETRIEVAL.hold_gpu else 0,
    log:
        f"{RETRIEVAL_LOG}/{{k}}-{{v}}-t{{tail}}{{opts}}.log",
    benchmark:
        "benchmarks/retrieval/{model}/ctx{n_ctx}/{k}-{v}-t{tail}{opts}.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/retrieval_cell.py"


rule retrieval_report:
    input:
        answers=lambda wildcards: kvret.require(RETRIEVAL).answer_files(),
        # the median-KLD ordering's summary: made by rule summary from this config's cells (the
        # workflow's own path), or an existing file; another path that is not there is reported as missing
        teacher_forced=lambda wildcards: kvret.teacher_forced_input(kvret.require(RETRIEVAL)),
    output:
        **kvret.report_files(),
    params:
        teacher_forced=lambda wildcards: kvret.require(RETRIEVAL).teacher_forced,
        reader=kvret.reader_digest(),  # the answers are rescored at report time: a new reader reruns the report
        bins=lambda wildcards: list(kvret.require(RETRIEVAL).distance_bins),
    log:
        "logs/retrieval/report.log",
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/retrieval_report.py"
