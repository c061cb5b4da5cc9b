# Helpers shared by the rule modules, and by workflow/rules/report.smk.
#
#   model_names()        -> [str]  the model names of the matrix, in config order
#   cell_dirs(model)     -> [str]  each cell's result directory for that model,
#                                  results/{model}/ctx{n_ctx}-c{chunks}/cells/{k}-{v}-t{tail}{opts}
#                                  (holds summary.json, tokens.parquet, row.parquet)
#   token_parquets(model)-> [str]  the per-token parquet of each of those cells
#   all_targets()        -> [str]  the default target: the summary + report_targets()
#
# The matrix is expanded and checked once, here, before any job is planned (kvarn.matrix).
# Per-cell parameters are read back from the wildcards of the cell path, never from the
# whole config, so adding or editing one cell plans only that cell.
from kvarn import matrix as kvm

MATRIX = kvm.expand(config)
MODELS = {name: vars(m) for name, m in MATRIX.models.items()}  # for lookup(dpath=...)


RUN = "results/{model}/ctx{n_ctx}-c{chunks}"
CELL = "results/{model}/ctx{n_ctx}-c{chunks}/cells/{k}-{v}-t{tail}{opts}"
LOG = "logs/{model}/ctx{n_ctx}-c{chunks}"
BENCH = "benchmarks/{model}/ctx{n_ctx}-c{chunks}"


def model_names():
    return list(MATRIX.models)


def cell_dirs(model):
    return [c.dir for c in MATRIX.cells if c.model == model]


def token_parquets(model):
    return [f"{d}/tokens.parquet" for d in cell_dirs(model)]


def all_targets():
    return ["results/summary.parquet", "results/summary.csv", *report_targets()]


def model_marker(wildcards):
    """The fetched-and-verified marker of a model; `ancient`: a re-verify never reruns cells."""
    return ancient(f"{config['model_cache']}/{wildcards.model}.fetched.json")


def model_param(key):
    return lookup(dpath=f"{{model}}/{key}", within=MODELS)


def cell_opt(key):
    return lambda wildcards: kvm.parse_opts(wildcards.opts)[key]


def format_version(role):
    """The numerics version of the cell's K or V type: bumping it reruns the cells using it."""
    return lambda wildcards: kvm.format_version(wildcards[role], role)


def cell_columns(wildcards):
    """family, tail label, versions, ... of a cell (kvarn.matrix.cell_columns), from its path."""
    return kvm.cell_columns(wildcards.k, wildcards.v, int(wildcards.tail), wildcards.opts)
