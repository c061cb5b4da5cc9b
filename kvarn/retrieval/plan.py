"""The `retrieval:` config key read into jobs and paths (torch-free: snakemake -n imports it).

Owns `expand` (the checked `Retrieval` plan, or None when the config has no `retrieval:` key),
the result layout (`TASKS_FILE`, `ANSWER_FILE`, `REPORT_FILES`) and the target lists the
workflow's rules read (workflow/rules/retrieval.smk). Every key is documented in
config/README.md; an error names the key, the bad value and what is accepted.

Layout, one file per (model, context, task) and per (model, context, task, cell):

    results/retrieval/{model}/ctx{n_ctx}/{task}/tasks.jsonl
    results/retrieval/{model}/ctx{n_ctx}/{task}/{k}-{v}-t{tail}{opts}.jsonl   (the cell's answers)

The baseline (`score.BASELINE_CELL`, the bf16 cache at tail 0) is one more cell of every
(model, context). A cell job answers every task of its (model, context) in one process (one model
load), writing one answer file per task.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvarn.retrieval.score import BASELINE_CELL
from kvarn.retrieval.tasks import TASK_VERSION, TASKS  # noqa: F401  (TASK_VERSION: the rules' param)
from kvarn.vocab.cell import CellSpec

RETRIEVAL_DIR = "results/retrieval"
RUN_DIR = RETRIEVAL_DIR + "/{model}/ctx{n_ctx}"
TASKS_FILE = RUN_DIR + "/{task}/tasks.jsonl"
ANSWER_FILE = RUN_DIR + "/{task}/{k}-{v}-t{tail}{opts}.jsonl"
REPORT_FILES = {
    "scores": "scores.parquet", "comparisons": "comparisons.parquet", "by_distance": "by_distance.parquet",
    "exact_tail": "exact_tail.parquet", "ordering": "ordering.parquet", "answers": "answers.parquet",
    "paired": "paired.parquet", "grid": "grid.parquet",
    "md": "retrieval.md", "paragraph": "README-paragraph.md",
}
SUMMARY = "results/summary.parquet"  # the teacher-forced run's table (workflow/rules/aggregate.smk)
FIGURE_STEM = RETRIEVAL_DIR + "/figures/retrieval"
HEATMAP_STEM = RETRIEVAL_DIR + "/figures/heatmap"  # length x depth, per (model, cell)
DEFAULTS = {"seed": 0, "gen_tokens": 8, "batch": 8, "threads": None, "tasks": list(TASKS), "depths": [0.25, 0.5, 1.0],
            "prompts": 2, "distance_bins": [0, 128, 512, 2048, 8192, 32768],
            "teacher_forced": SUMMARY, "hold_gpu": True}
_TOP = set(DEFAULTS) | {"models", "cells"}
_MODEL = {"name", "contexts", "depths", "prompts", "cells"}


class RetrievalError(ValueError):
    """A `retrieval:` value the plan refuses; the message starts with where it is."""


@dataclass(frozen=True)
class RetrievalModel:
    name: str
    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    prompts: int
    cells: tuple[str, ...]  # the baseline first, then the config's cells


@dataclass(frozen=True)
class Retrieval:
    tasks: tuple[str, ...]
    seed: int
    gen_tokens: int
    batch: int
    threads: int | None
    distance_bins: tuple[int, ...]
    teacher_forced: str
    models: dict[str, RetrievalModel]
    hold_gpu: bool = True  # a cell job holds the run's one `gpu` resource (false: CPU jobs side by side)

    def task_spec(self, model: str) -> dict:
        """What a model's task files are made from: a change reruns its task and answer jobs."""
        m = self.models[model]
        return {"depths": list(m.depths), "prompts": m.prompts, "seed": self.seed, "gen_tokens": self.gen_tokens}

    def task_files(self) -> list[str]:
        return [TASKS_FILE.format(model=m.name, n_ctx=c, task=t)
                for m in self.models.values() for c in m.contexts for t in self.tasks]

    def answer_files(self, model: str | None = None, n_ctx: int | None = None, cell: str | None = None) -> list[str]:
        """Every answer file, or those of one model / context / cell."""
        out = []
        for m in self.models.values():
            if model is not None and m.name != model:
                continue
            for c in m.contexts:
                if n_ctx is not None and c != int(n_ctx):
                    continue
                for name in m.cells:
                    if cell is not None and name != cell:
                        continue
                    spec = CellSpec.from_name(name)
                    out += [ANSWER_FILE.format(model=m.name, n_ctx=c, task=t, k=spec.k, v=spec.v, tail=spec.tail,
                                               opts=spec.opts) for t in self.tasks]
        return out

    def n_jobs(self) -> int:
        """The jobs of `snakemake retrieval` from nothing: the task files, one cell job per
        (model, context, cell, baseline included), the report and the target rule (model fetches and
        the teacher-forced companion run that makes the report's `teacher_forced` summary aside)."""
        cells = sum(len(m.contexts) * len(m.cells) for m in self.models.values())
        return len(self.task_files()) + cells + 2


def report_files() -> dict[str, str]:
    """The report's outputs by name: the tables, the Markdown, the paragraph and the figure."""
    from kvarn.report.workflow import FIGURE_FORMATS

    out = {k: f"{RETRIEVAL_DIR}/{v}" for k, v in REPORT_FILES.items()}
    out.update({f"figure_{ext.replace('.', '_')}": f"{FIGURE_STEM}.{ext}" for ext in FIGURE_FORMATS})
    out.update({f"heatmap_{ext.replace('.', '_')}": f"{HEATMAP_STEM}.{ext}" for ext in FIGURE_FORMATS})
    return out


def teacher_forced_input(plan: Retrieval) -> list[str]:
    """The report's declared teacher-forced input: the configured summary when it is the workflow's
    own (`SUMMARY`, made by rule summary from the config's cells) or already exists, else nothing
    (the report then says that there is no teacher-forced summary)."""
    path = plan.teacher_forced
    return [path] if path == SUMMARY or Path(path).is_file() else []


def reader_digest() -> str:
    """16 hex digits of the answer reader's code (`score.read_answer` and its pattern): a param of
    the report rule, so that a changed reader reruns the report, which rescores the stored answers."""
    import hashlib
    import inspect

    from kvarn.retrieval import score

    src = inspect.getsource(score.read_answer) + score.DIGITS.pattern + inspect.getsource(score.grade) + "".join(
        p.pattern for p in score.VALUE_PATTERNS.values())
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def require(plan: Retrieval | None) -> Retrieval:
    """The plan, or a RetrievalError saying which config to run a retrieval target with."""
    if plan is None:
        raise RetrievalError("target retrieval: this config has no `retrieval:` key; run it with "
                             "--configfile config/retrieval.yaml (config/README.md)")
    return plan


def targets(plan: Retrieval | None) -> list[str]:
    """What the target rule `retrieval` asks for: every report file (a config without `retrieval:` is refused)."""
    require(plan)
    return list(report_files().values())


def _where(*parts) -> str:
    """retrieval.models[0].name from ("models", 0, "name")."""
    return "retrieval" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _int(where: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise RetrievalError(f"{where}: must be an integer >= {lo}, got {x!r}")
    return x


def _depths(where: str, x) -> tuple[float, ...]:
    if not isinstance(x, list) or not x:
        raise RetrievalError(f"{where}: must be a non-empty list of numbers in [0, 1], got {x!r}")
    for i, d in enumerate(x):
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise RetrievalError(f"{where}[{i}]: a depth must be a number in [0, 1] (0: right after the intro, "
                                 f"1: right before the question), got {d!r}")
    if len(set(x)) != len(x):
        raise RetrievalError(f"{where}: a depth is listed twice in {x!r}")
    return tuple(float(d) for d in x)


def _cells(where: str, x) -> tuple[str, ...]:
    if not isinstance(x, list) or not x:
        raise RetrievalError(f"{where}: must be a non-empty list of cell names such as q4_0-q4_0-t128, got {x!r}")
    out = []
    for i, name in enumerate(x):
        try:
            spec = CellSpec.from_name(name)
        except ValueError as e:
            raise RetrievalError(f"{where}[{i}]: {e}") from None
        if spec.compute != "exact":
            raise RetrievalError(f"{where}[{i}]: {name!r}: retrieval runs the exact compute path only")
        if name != BASELINE_CELL and name not in out:
            out.append(name)
    return (BASELINE_CELL, *out)


def expand(config: dict, model_names) -> Retrieval | None:
    """The checked plan of `config["retrieval"]`, None without that key. `model_names`: the
    config's models of the torch engine (each retrieval model must be one: its source and
    revision come from there)."""
    raw = config.get("retrieval")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RetrievalError(f"retrieval: must be a mapping of the keys {', '.join(sorted(_TOP))}, got {raw!r}")
    extra = sorted(set(raw) - _TOP)
    if extra:
        raise RetrievalError(f"retrieval.{extra[0]}: unknown key; accepted: {', '.join(sorted(_TOP))}")
    r = {**DEFAULTS, **raw}
    tasks = r["tasks"]
    if not isinstance(tasks, list) or not tasks:
        raise RetrievalError(f"retrieval.tasks: must be a non-empty list of {', '.join(TASKS)}, got {tasks!r}")
    for i, t in enumerate(tasks):
        if t not in TASKS:
            raise RetrievalError(f"retrieval.tasks[{i}]: unknown task {t!r}; accepted: {', '.join(TASKS)}")
    threads = None if r["threads"] is None else _int("retrieval.threads", r["threads"], 1)
    bins = r["distance_bins"]
    if not isinstance(bins, list) or not bins or any(isinstance(b, bool) or not isinstance(b, int) for b in bins) \
            or bins != sorted(set(bins)) or bins[0] != 0:
        raise RetrievalError(f"retrieval.distance_bins: must be increasing integers starting at 0, got {bins!r}")
    if not isinstance(r["hold_gpu"], bool):
        raise RetrievalError(f"retrieval.hold_gpu: must be true (a cell job holds the run's one `gpu` resource: one "
                             f"at a time, as on a GPU node) or false (CPU: --cores N runs cell jobs side by side), "
                             f"got {r['hold_gpu']!r}")
    if not isinstance(r["teacher_forced"], str):
        raise RetrievalError(f"retrieval.teacher_forced: must be a path, got {r['teacher_forced']!r}")
    if "cells" not in raw:
        raise RetrievalError("retrieval.cells: required (a list of cell names such as kvarn4-kvarn4-t0)")
    cells = _cells("retrieval.cells", r["cells"])
    depths = _depths("retrieval.depths", r["depths"])
    prompts = _int("retrieval.prompts", r["prompts"], 1)
    gen_tokens = _int("retrieval.gen_tokens", r["gen_tokens"], 1)
    models_raw = r.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise RetrievalError("retrieval.models: required, a non-empty list of {name, contexts, ...}")
    names = list(model_names)
    models: dict[str, RetrievalModel] = {}
    for i, m in enumerate(models_raw):
        if not isinstance(m, dict):
            raise RetrievalError(f"{_where('models', i)}: must be a mapping with name and contexts, got {m!r}")
        extra = sorted(set(m) - _MODEL)
        if extra:
            raise RetrievalError(f"{_where('models', i, extra[0])}: unknown key; accepted: {', '.join(sorted(_MODEL))}")
        name = m.get("name")
        if name not in names:
            raise RetrievalError(f"{_where('models', i, 'name')}: {name!r} is not a model of this config's `models` "
                                 f"(torch engine); accepted: {', '.join(names) or 'none'}")
        if name in models:
            raise RetrievalError(f"{_where('models', i, 'name')}: {name!r} is listed twice")
        ctx = m.get("contexts")
        if not isinstance(ctx, list) or not ctx:
            raise RetrievalError(f"{_where('models', i, 'contexts')}: must be a non-empty list of context lengths, "
                                 f"got {ctx!r}")
        contexts = tuple(_int(_where("models", i, "contexts", j), c, gen_tokens + 64) for j, c in enumerate(ctx))
        models[name] = RetrievalModel(
            name=name, contexts=contexts,
            depths=_depths(_where("models", i, "depths"), m["depths"]) if "depths" in m else depths,
            prompts=_int(_where("models", i, "prompts"), m["prompts"], 1) if "prompts" in m else prompts,
            cells=_cells(_where("models", i, "cells"), m["cells"]) if "cells" in m else cells)
    return Retrieval(tasks=tuple(tasks), seed=_int("retrieval.seed", r["seed"], 0), gen_tokens=gen_tokens,
                     batch=_int("retrieval.batch", r["batch"], 1), threads=threads, distance_bins=tuple(bins),
                     teacher_forced=r["teacher_forced"], models=models, hold_gpu=r["hold_gpu"])
