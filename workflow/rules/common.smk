# Helpers shared by the rule modules, and by workflow/rules/report.smk.
#
#   model_names()        -> [str]  the model names of the matrix, in config order
#   cell_dirs(model)     -> [str]  each cell's result directory for that model,
#                                  results/{model}/ctx{n_ctx}-c{chunks}/cells/{k}-{v}-t{tail}{opts}
#                                  (holds summary.json, tokens.parquet, row.parquet)
#   token_parquets(model)-> [str]  the per-token parquet of each of those cells
#   decode_targets()     -> [str]  every (cell, decode) summary.json + each decoding model's figure
#   all_targets()        -> [str]  the default target: the summary + report_targets() + decode_targets()
#
# The matrix is expanded and checked once, here, before any job is planned (kvarn.plan.matrix); the
# results layout is kvarn.plan.paths's, a cell's row columns kvarn.plan.rows's.
# Per-cell parameters are read back from the wildcards of the cell path, never from the
# whole config, so adding or editing one cell plans only that cell.
import dataclasses
import json
import os

from snakemake.exceptions import WorkflowError

from kvarn.plan import allocations as kva
from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.plan import rows as kvrows
from kvarn.plan.slurm import cpus_per_task

MATRIX = kvm.expand(config)
# The per-layer study (kvarn.perlayer, workflow/rules/perlayer.smk) adds the uniform cells it compares against.
from kvarn.perlayer import plan as kvpl

PERLAYER = kvpl.expand(config)
if PERLAYER is not None:
    MATRIX = kvm.expand(kvpl.with_uniform_cells(config, PERLAYER, [n for n, m in MATRIX.models.items()
                                                                   if m.engine == "torch"]))
for _note in kvm.check_pinned(MATRIX.models, config.get("allow_unpinned", False), plan_only=True):
    sys.stderr.write(f"kvarn: unpinned model {_note}; fetch_model refuses it without --config allow_unpinned=true\n")
MODELS = {name: vars(m) for name, m in MATRIX.models.items()}  # for lookup(dpath=...)


# Model-running jobs (baseline, cell, decode) take every core the run was given: they run
# one at a time anyway (each declares the one `gpu`), and torch sizes its thread pool from
# OMP_NUM_THREADS, which Snakemake sets to the job's threads (1 unless declared, i.e. one
# core of a CPU machine left idle). At most this machine's cores (a remote executor may
# report an unbounded --cores, or none). Inside a Slurm allocation, its CPUs per task
# (SLURM_CPUS_PER_TASK: the profile's cpus_per_task): without CPU binding, the cores
# Snakemake sees are the whole node's.
def _model_threads() -> int:
    slurm_cpus = cpus_per_task()
    if slurm_cpus is not None:
        return slurm_cpus
    try:
        cores = workflow.cores  # raises when a remote executor runs without --cores
    except WorkflowError:
        return 1
    return min(cores, os.cpu_count() or 1) if isinstance(cores, int) else 1


MODEL_THREADS = _model_threads()


RUN = kvp.RUN_DIR  # the results layout is kvarn.plan.paths's
CELL = kvp.CELL_DIR
LOG = "logs/{model}/ctx{n_ctx}-c{chunks}"
BENCH = "benchmarks/{model}/ctx{n_ctx}-c{chunks}"


def model_names():
    return list(MATRIX.models)


def cell_dirs(model):
    return [c.dir for c in MATRIX.cells if c.model == model]


def token_parquets(model):
    return [f"{d}/tokens.parquet" for d in cell_dirs(model)]


def all_targets():
    return ["results/summary.parquet", "results/summary.csv", *report_targets(), *decode_targets()]


def decode_targets():
    """Every (cell, decode) summary (kvarn.plan.matrix.Matrix.decode_dirs) and each decoding model's figure."""
    from kvarn.report.workflow import FIGURE_FORMATS

    models = [m for m in MATRIX.models if MATRIX.decode_dirs(m)]
    return [f"{d}/summary.json" for d in MATRIX.decode_dirs()] + [
        f"results/figures/{m}/decode.{ext}" for m in models for ext in FIGURE_FORMATS
    ]


def source_key(model):
    return kvp.source_key(MODELS[model]["source"], MODELS[model]["revision"])


def model_marker(wildcards):
    """The fetched-and-verified marker of a model's current source.

    `ancient`: re-verifying never reruns cells (a changed source reruns them through their
    own params). fetch_model has no params and is a `run:` block, so it reruns only when its
    marker is missing: a producer rerun over an existing `ancient` output would, through
    snakemake/snakemake#4166, make that invocation plan nothing downstream of it.
    """
    return ancient(f"{config['model_cache']}/{wildcards.model}.{source_key(wildcards.model)}.fetched.json")


def model_param(key):
    return lookup(dpath=f"{{model}}/{key}", within=MODELS)


def cell_fields(wildcards) -> dict:
    """The job's cell (kvarn.vocab.cell.CellSpec, read from its path), every field, as one param:
    a changed option reruns the job, and so does a changed default, which the path leaves out."""
    return dataclasses.asdict(kvm.CellSpec.from_wildcards(wildcards))


def cell_baseline(wildcards):
    """The cell's baseline dump: results/.../baseline.kvd, baseline-llamacpp_cpu.kvd for that compute path,
    or baseline.llama.kld for a model of the llama.cpp engine."""
    run = RUN.format(model=wildcards.model, n_ctx=wildcards.n_ctx, chunks=wildcards.chunks)
    return kvp.baseline_path(run, kvm.CellSpec.from_wildcards(wildcards).compute,
                             MATRIX.models[wildcards.model].engine)


# The models of each engine (kvarn.llamacpp_engine.settings): the torch engine's rules and the llama.cpp
# engine's produce the same cell files, each for its own models (a pattern that matches none: "(?!)").
def _models_pattern(engine):
    import re

    names = [re.escape(n) for n, m in MATRIX.models.items() if m.engine == engine]
    return "|".join(names) if names else "(?!)"


TORCH_MODELS = _models_pattern("torch")
PROGRAM_MODELS = _models_pattern(kvm.LLAMACPP)
_PLANNED_BUILDS = {}


def engine_param(wildcards) -> dict:
    """A llama.cpp-engine model's settings and its build's identity as read when planning
    (kvarn.llamacpp_engine.build.plan_identity): a changed build or setting reruns its baseline and cells."""
    from kvarn.llamacpp_engine.build import plan_identity

    settings = MODELS[wildcards.model]["engine_settings"]
    key = settings.get("build")
    if key not in _PLANNED_BUILDS:
        _PLANNED_BUILDS[key] = plan_identity(key)
    return {"settings": settings, "build": _PLANNED_BUILDS[key]}


def format_versions(wildcards) -> dict:
    """The numerics versions of the cell's K and V types: bumping one reruns the cells using it."""
    return {role: kvrows.format_version(wildcards[role], role) for role in ("k", "v")}


def cell_columns(wildcards):
    """family, tail label, versions, ... of a cell (kvarn.plan.rows.cell_columns), from its path,
    and its model's memory accounting: changing that reruns the row jobs, not the cells."""
    return kvrows.cell_columns(kvm.CellSpec.from_wildcards(wildcards), MODELS[wildcards.model]["memory_accounting"])


# fetch_model and wikitext run these in `run:` blocks without params, not scripts: their
# outputs are consumed `ancient`, and a rerun of an existing output (a script newer than it,
# as in a fresh copy of the workflow over a shared model cache, or a changed param) would,
# through snakemake/snakemake#4166, make that invocation plan nothing downstream of it.


def fetch_model_marker(marker, model, key, log):
    """kvarn.weights.sources.fetch of `model`'s source into the marker's directory; the marker lists what was fetched."""
    import contextlib, json, os, time
    from pathlib import Path
    from kvarn.weights.sources import ModelSpec, fetch

    m = MODELS[model]
    kvm.check_pinned({model: MATRIX.models[model]}, config.get("allow_unpinned", False))
    if key != source_key(model):
        raise ValueError(f"{marker} is not the marker of {m['source']}@{m['revision']}; run snakemake without naming it")
    spec = ModelSpec(model, m["source"], m["revision"])
    marker = Path(marker)
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        t0 = time.time()
        path = Path(fetch(spec, cache_dir=marker.parent))
        files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
        if not files:
            raise RuntimeError(f"kvarn.weights.sources.fetch({spec}) returned {path}, which holds no files")
        print(f"fetched {spec} -> {path} in {time.time() - t0:.1f}s")
        record = {"name": spec.name, "source": spec.source, "revision": spec.revision, "path": str(path),
                  "files": {str(p.relative_to(path)) if p != path else p.name: p.stat().st_size for p in files}}
        tmp = marker.with_name(f".{marker.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, marker)


def copy_wikitext(source, out, log, split="test"):
    """The Wikitext-2 `split`'s raw file (wiki.test.raw; "validation": wiki.valid.raw) from `source` (a path;
    None or missing: the hub), sha256-verified, to `out`."""
    import contextlib, os
    from pathlib import Path
    from kvarn.baseline.data import SPLITS, load_text, text_sha256

    name = SPLITS[split][0]
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        if source is not None and not Path(source).is_file():
            print(f"text: {source!r} does not exist; rebuilding {name} from the Hugging Face hub")
            source = None
        text = load_text(source, split=split)  # raises unless the bytes are the original file's
        tmp = Path(f"{out}.tmp{os.getpid()}")
        tmp.write_bytes(text.encode("utf-8"))
        os.replace(tmp, out)
        print(f"{name} from {source or 'the hub'}: {len(text.encode()):,} bytes, sha256 {text_sha256(text)}")


# The per-layer study's helpers (workflow/rules/perlayer.smk; rule summary reads perlayer_cells).
def perlayer_plan():
    if PERLAYER is None:
        raise WorkflowError("target perlayer needs a perlayer: key; add --configfile config/perlayer.yaml")
    return PERLAYER


def perlayer_run(model):
    """The (n_ctx, chunks) of the model's run the allocations are judged on: its first n_ctx."""
    m = MATRIX.models[model]
    return m.n_ctx[0], m.chunks


def perlayer_cells(model):
    """The cell directories of the model's searched allocations, once their searches have run (each
    allocation published where its cell job looks it up)."""
    n_ctx, chunks = perlayer_run(model)
    out, allocs = [], []
    for budget in perlayer_plan().budgets:
        path = checkpoints.perlayer_search.get(model=model, budget=budget).output[0]
        for e in json.loads(open(path).read())["allocations"]:
            allocs.append(kvm.allocation.Allocation.from_record(e["record"], path))
            out.append(f"{kvp.RUN_DIR.format(model=model, n_ctx=n_ctx, chunks=chunks)}/cells/{e['cell']}")
    kva.publish_allocations([a for a in allocs if not a.uniform])
    return list(dict.fromkeys(out))


def perlayer_searches():
    return [kvpl.SEARCH_FILE.format(model=m, budget=b) for m, mm in MATRIX.models.items() if mm.engine == "torch"
            for b in perlayer_plan().budgets]


def perlayer_heatmaps():
    from kvarn.report.workflow import FIGURE_FORMATS

    models = [n for n, m in MATRIX.models.items() if m.engine == "torch"]
    return [f"{kvpl.HEATMAP.format(model=m)}.{ext}" for m in models for ext in FIGURE_FORMATS]


def perlayer_targets():
    return [*kvpl.TABLE_FILES.values(), *perlayer_heatmaps()]
