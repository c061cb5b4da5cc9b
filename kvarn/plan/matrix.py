"""The study matrix: `config/matrix.yaml` expanded into cells, and the checks a JSON schema cannot make.

Owns `expand` (a config to a `Matrix` of `Model`s, `Cell`s and their `Decode` axes; a refused
config raises `MatrixError`, starting with the offending field), `check_pinned` (unpinned model
sources), `check_attention` and the defaults `MODEL_DEFAULTS`, `CELL_DEFAULTS`. A *cell* is one
quantized run (model, n_ctx, chunks, K type, V type, requested tail, options); its identity is its
path (`kvarn.plan.paths`), so adding a cell to the config adds a path and nothing else moves.
Allocations (`kvarn.vocab.allocation`) are checked here, before any job; their cells are
`{k}-{v}-t{tail}-a{name}.{digest}`. Pure Python over the type facts (`kvarn.vocab.facts`: no
torch, no model, no download), so `snakemake -n` of any matrix plans without a network.

The config, key by key: config/README.md. Why a cell is a path: docs/notes/workflow.md; why
an allocation's digest is in its name, and what is checked where: docs/notes/per-layer.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

from kvarn.vocab import allocation, facts
from kvarn.budget.memory import ACCOUNTINGS
from kvarn.plan.paths import ALL_CHUNKS, RUN_DIR, baseline_path, decode_dir
from kvarn.vocab.allocation import Allocation, AllocationError
from kvarn.vocab.cell import CellError, CellSpec, cell_spec, parse_opts
from kvarn.vocab.options import ATTENTIONS, DTYPES, check_sampling, sampling_name
from kvarn.llamacpp_engine.settings import ENGINE as LLAMACPP, Settings, engine_of
from kvarn.weights.sources import unpinned

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._]*(?:-[A-Za-z0-9._]+)*$")
SOURCE_RE = re.compile(r"^(embedded:[A-Za-z0-9._-]+|hf:[^/\s]+/[^/\s]+|[^:\s][^\s]*)$")
MODEL_DEFAULTS = {"revision": None, "n_ctx": [512], "chunks": 4, "ubatch": 512, "dtype": "auto",
                  "memory_accounting": "packed", "engine": None}
CELL_DEFAULTS = parse_opts("")  # a cell's options when the config names none (kvarn.vocab.cell)


class MatrixError(ValueError):
    """A config the workflow refuses; the message starts with the offending field."""


@dataclass(frozen=True)
class Decode:
    """A model's free-running decode axis (kvarn.run.decode): P prompts, G generated tokens, the
    cells (directory names) decoded (None = every cell of the model), and how tokens are chosen:
    temperature 0 greedy, T > 0 sampled with the Gumbel noise of `seed`."""

    prompts: int = 8
    tokens: int = 128
    cells: tuple[str, ...] | None = None
    temperature: float = 0.0
    seed: int = 0

    @property
    def sampling(self) -> str:
        """The decode run directory's suffix (kvarn.vocab.options.sampling_name): "" when greedy."""
        return sampling_name(self.temperature, self.seed)


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    revision: str | None
    n_ctx: tuple[int, ...]
    chunks: int | str  # a count, or ALL_CHUNKS
    ubatch: int
    dtype: str
    memory_accounting: str = "packed"
    decode: Decode | None = None
    engine: str = "torch"  # kvarn.llamacpp_engine.settings.ENGINES
    engine_settings: dict | None = None  # the llama.cpp engine's block (kvarn.llamacpp_engine.settings.Settings)


@dataclass(frozen=True)
class Cell(CellSpec):
    """One planned cell: a CellSpec (types, tail, options; its `name` and `opts`) in a run of a
    model at n_ctx over `chunks` chunks."""

    model: str = field(kw_only=True)
    n_ctx: int = field(kw_only=True)
    chunks: int | str = field(kw_only=True)  # a count, or ALL_CHUNKS
    engine: str = field(default="torch", kw_only=True)  # the model's engine: not in the cell's path
    alloc: str | None = field(default=None, kw_only=True)  # the allocation's token (kvarn.vocab.allocation)

    @property
    def spec(self) -> CellSpec:
        """What identifies the cell within its run (kvarn.vocab.cell): types, tail, options, allocation."""
        return cell_spec(**{f.name: getattr(self, f.name) for f in fields(CellSpec)}, alloc=self.alloc)

    @property
    def run_dir(self) -> str:
        return RUN_DIR.format(model=self.model, n_ctx=self.n_ctx, chunks=self.chunks)

    @property
    def dir(self) -> str:
        return f"{self.run_dir}/cells/{self.name}"

    @property
    def baseline(self) -> str:
        """The baseline dump this cell scores against: one per (model, n_ctx, chunks, compute), or the
        llama.cpp engine's base file."""
        return baseline_path(self.run_dir, self.compute, self.engine)


@dataclass
class Matrix:
    models: dict[str, Model]
    cells: list[Cell] = field(default_factory=list)
    attention: str = "auto"  # the jobs' attention path (ATTENTIONS); in no cell's path
    allocations: dict[str, Allocation] = field(default_factory=dict)  # the config's, by name

    def runs(self) -> list[tuple[str, int, int]]:
        """The (model, n_ctx, chunks) runs the cells need, in first-use order."""
        return list(dict.fromkeys((c.model, c.n_ctx, c.chunks) for c in self.cells))

    def decode_dirs(self, model: str | None = None) -> list[str]:
        """Every (cell, decode) result directory (of one model, or all)."""
        out = []
        for c in self.cells:
            d = self.models[c.model].decode
            if d is not None and (model is None or c.model == model) and (d.cells is None or c.name in d.cells):
                out.append(decode_dir(c.model, c.n_ctx, d.prompts, d.tokens, c.name, d.sampling))
        return out

    def baselines(self) -> list[str]:
        """The baseline dumps the cells need (one per run and compute path), in first-use order."""
        return list(dict.fromkeys(c.baseline for c in self.cells))

def _chunks(where: str, x) -> int | str:
    if x == ALL_CHUNKS:
        return x
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise MatrixError(f"{where}: {x!r} must be an integer >= 1 or \"all\" (every chunk of the text)")
    return x


def check_pinned(models: dict[str, Model], allow, plan_only: bool = False) -> list[str]:
    """Refuse models whose weights are not pinned (`kvarn.weights.sources.unpinned`) unless `allow` (the config's
    ``allow_unpinned``, e.g. ``snakemake --config allow_unpinned=true``): their results would
    name a revision that can change under them. `plan_only`: planning (``snakemake -n``)
    may proceed; the messages are returned for a note, and the fetch job refuses."""
    if not isinstance(allow, bool):
        raise MatrixError(f"allow_unpinned: {allow!r} must be true or false")
    loose = [f"{n}: {why}" for n, m in models.items() if (why := unpinned(m.source, m.revision))]
    if loose and not allow and not plan_only:
        raise MatrixError(
            "models: unpinned weights: " + "; ".join(loose)
            + ". Pin each (revision: <40-hex commit>, or sha256:<hex> for a GGUF) or run with "
            "--config allow_unpinned=true (the summaries then record the commit that was fetched)")
    return [] if allow else loose


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _int(where: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise MatrixError(f"{where}: {x!r} must be an integer >= {lo}")
    return x


def check_attention(value) -> str:
    """The top-level `attention` key: one of ATTENTIONS (kvarn.kvcache.attention.resolve_attention)."""
    if value not in ATTENTIONS:
        raise MatrixError(f"attention: {value!r} is not an attention path; accepted: {', '.join(ATTENTIONS)} "
                          "(auto: flex on CUDA, ref on CPU)")
    return value


def _models(config: dict) -> dict[str, Model]:
    raw = config.get("models")
    if not isinstance(raw, list) or not raw:
        raise MatrixError("models: give a non-empty list of models (name, source, n_ctx, ...)")
    models: dict[str, Model] = {}
    for i, m in enumerate(raw):
        where = f"models[{i}]"
        if not isinstance(m, dict):
            raise MatrixError(f"{where}: expected a mapping with name and source, got {m!r}")
        m = {**MODEL_DEFAULTS, **m}
        name = m.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise MatrixError(f"{where}.name: {name!r} is not a model name (letters, digits, '.', '_', '-')")
        if name in models:
            j = [x.get("name") for x in raw].index(name)
            raise MatrixError(f"{where}.name: duplicate model name {name!r} (also models[{j}].name)")
        source = m.get("source")
        if not isinstance(source, str) or not SOURCE_RE.match(source):
            raise MatrixError(
                f"{where}.source: model {name!r} needs a source: 'embedded:NAME', 'hf:org/repo', "
                f"'hf:org/repo/file.gguf', 'random:CONFIG.json' or a local directory or .gguf path; got {source!r}")
        n_ctx = tuple(_int(f"{where}.n_ctx", n, 4) for n in _as_list(m["n_ctx"]))
        for n in n_ctx:
            if n % 2:
                raise MatrixError(f"{where}.n_ctx: {n} is odd; n_ctx must be even (scored positions n_ctx/2 .. n_ctx-2)")
        if len(set(n_ctx)) != len(n_ctx) or not n_ctx:
            raise MatrixError(f"{where}.n_ctx: {list(n_ctx)} must be a non-empty list without repeats")
        if m["dtype"] not in DTYPES:
            raise MatrixError(f"{where}.dtype: {m['dtype']!r}; accepted: {', '.join(DTYPES)}")
        if m["memory_accounting"] not in ACCOUNTINGS:
            raise MatrixError(f"{where}.memory_accounting: {m['memory_accounting']!r} is not a memory accounting; "
                              f"accepted: {', '.join(ACCOUNTINGS)}")
        try:
            engine, block = engine_of(m["engine"])
            settings = Settings.from_config(block, f"{where}.engine").as_param() if engine == LLAMACPP else None
        except ValueError as e:
            raise MatrixError(str(e) if str(e).startswith(where) else f"{where}.{e}") from None
        if engine == LLAMACPP and m.get("decode") is not None:
            raise MatrixError(f"{where}.decode: the free-running decode is the torch engine's; model {name!r} "
                              "runs engine llama.cpp")
        models[name] = Model(name, source, m["revision"], n_ctx, _chunks(f"{where}.chunks", m["chunks"]),
                             _int(f"{where}.ubatch", m["ubatch"], 1), m["dtype"], m["memory_accounting"],
                             _decode(f"{where}.decode", m.get("decode"), n_ctx), engine, settings)
    return models


def _decode(where: str, raw, n_ctx: tuple[int, ...]) -> Decode | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"prompts", "tokens", "cells", "temperature", "seed"}:
        raise MatrixError(f"{where}: {raw!r}; expected a mapping of prompts, tokens and (optionally) cells, "
                          f"temperature and seed")
    d = Decode(**{**vars(Decode()), **raw})
    _int(f"{where}.prompts", d.prompts, 1)
    _int(f"{where}.tokens", d.tokens, 1)
    try:
        temperature, seed = check_sampling(d.temperature, d.seed)
    except ValueError as e:
        raise MatrixError(f"{where}: {e}") from None
    d = replace(d, temperature=temperature, seed=seed)
    for n in n_ctx:
        if d.tokens > n - 2:
            raise MatrixError(f"{where}.tokens: {d.tokens} leaves no prompt in n_ctx {n}; "
                              f"at most n_ctx - 2 = {n - 2} (the prompt is the first n_ctx - tokens tokens)")
    if d.cells is not None:
        if not isinstance(d.cells, (list, tuple)) or not all(isinstance(c, str) for c in d.cells):
            raise MatrixError(f"{where}.cells: {d.cells!r}; expected a list of cell names like q4_0-q4_0-t128")
        d = replace(d, cells=tuple(d.cells))
    return d


def _pairs(where: str, entry: dict) -> list[tuple[str, str, dict]]:
    """(k, v, fields) for one cells entry: `fields` names the config field of the K type ("k"),
    the V type ("v") and the pair ("pair"), for the messages of `_cell_spec`."""
    kinds = [key for key in ("types", "k", "pairs") if key in entry]
    if kinds == ["k"] and "v" in entry:
        ks, vs = _as_list(entry["k"]), _as_list(entry["v"])
        return [(k, v, {"k": f"{where}.k[{i}]", "v": f"{where}.v[{j}]", "pair": f"{where}.k/v"})
                for i, k in enumerate(ks) for j, v in enumerate(vs)]
    if kinds == ["types"] and "v" not in entry:
        out = []
        for i, t in enumerate(_as_list(entry["types"])):
            f = f"{where}.types[{i}]"
            out.append((t, t, {"k": f, "v": f, "pair": f}))
        return out
    if kinds == ["pairs"] and "v" not in entry:
        out = []
        for i, p in enumerate(_as_list(entry["pairs"])):
            parts = p.split("/") if isinstance(p, str) else p
            f = f"{where}.pairs[{i}]"
            if not isinstance(parts, (list, tuple)) or len(parts) != 2:
                raise MatrixError(f"{f}: {p!r} is not a pair; write it 'K/V', e.g. q8_0/q4_0")
            out.append((parts[0], parts[1], {"k": f, "v": f, "pair": f}))
        return out
    raise MatrixError(f"{where}: give exactly one of 'types' (K = V), 'k' and 'v' (their product) or 'pairs' ('K/V')")


def _allocations(config: dict) -> dict[str, Allocation]:
    """The config's `allocations:`, each checked (kvarn.vocab.allocation) and defined in this process."""
    raw = config.get("allocations") or {}
    if not isinstance(raw, dict):
        raise MatrixError(f"allocations: {raw!r}; give a mapping of names to {{k, v, k_first, k_last, v_first, v_last}}")
    try:
        return {name: allocation.define(Allocation.parse(name, a, f"allocations.{name}")) for name, a in raw.items()}
    except AllocationError as e:
        raise MatrixError(str(e)) from None


def _alloc_pairs(where: str, entry: dict, allocs: dict[str, Allocation]) -> list[tuple[str, str, dict, str]]:
    """(k, v, fields, token) for a group of allocations: K and V their main types."""
    if any(key in entry for key in ("types", "k", "v", "pairs")):
        raise MatrixError(f"{where}: give exactly one of 'types' (K = V), 'k' and 'v' (their product), 'pairs' ('K/V') "
                          "or 'alloc' (named allocations)")
    out = []
    for i, name in enumerate(_as_list(entry["alloc"])):
        f = f"{where}.alloc[{i}]"
        if name not in allocs:
            raise MatrixError(f"{f}: unknown allocation {name!r}; defined: "
                              f"{', '.join(allocs) or 'none (name them under allocations:)'}")
        a = allocs[name]
        out.append((*a.base, {"k": f, "v": f, "pair": f, "alloc": f}, a.token))
    return out


def expand(config: dict) -> Matrix:
    """The checked, de-duplicated cell list of a (schema-validated or raw) config."""
    models = _models(config)
    check_pinned(models, config.get("allow_unpinned", False), plan_only=True)
    allocs = _allocations(config)
    cells: dict[Cell, None] = {}
    raw = config.get("cells")
    if not isinstance(raw, list) or not raw:
        raise MatrixError("cells: give a non-empty list of cell groups (types/k+v/pairs with tail)")
    for i, entry in enumerate(raw):
        where = f"cells[{i}]"
        if not isinstance(entry, dict):
            raise MatrixError(f"{where}: expected a mapping, got {entry!r}")
        opts = {k: entry[k] for k in CELL_DEFAULTS if k in entry}
        tails = _as_list(entry.get("tail", 0))
        names = _as_list(entry.get("models", list(models)))
        for n in names:
            if n not in models:
                raise MatrixError(f"{where}.models: unknown model {n!r}; defined: {', '.join(models)}")
        pairs = (_alloc_pairs(where, entry, allocs) if "alloc" in entry
                 else [(k, v, flds, None) for k, v, flds in _pairs(where, entry)])
        for k, v, flds, token in pairs:
            specs = [_cell_spec(where, flds, k, v, tail, opts, token) for tail in tails]  # each checked once
            for name in names:
                m = models[name]
                for n_ctx in m.n_ctx:
                    for spec in specs:
                        if spec.tail >= n_ctx:
                            raise MatrixError(f"{where}.tail: {spec.tail} must be < n_ctx {n_ctx} of model {name!r}")
                        cell = _normalize(Cell(**{f.name: getattr(spec, f.name) for f in fields(CellSpec)},
                                               alloc=spec.alloc, model=name, n_ctx=n_ctx, chunks=m.chunks,
                                               engine=m.engine))
                        if m.engine == LLAMACPP:
                            _check_program_cell(where, name, cell)
                        cells[cell] = None
    for i, m in enumerate(models.values()):
        if m.decode is not None and m.decode.cells is not None:
            have = [c.name for c in cells if c.model == m.name]
            for j, c in enumerate(m.decode.cells):
                if c not in have:
                    raise MatrixError(f"models[{i}].decode.cells[{j}]: {c!r} is not a cell of model {m.name!r}; "
                                      f"its cells: {', '.join(have)}")
    return Matrix(models, list(cells), check_attention(config.get("attention", "auto")), allocs)


def _check_program_cell(where: str, model: str, spec: CellSpec) -> None:
    """The options the llama.cpp engine cannot take whatever the build (kvarn.llamacpp_engine.runner.cell_args
    checks the types and the tail against the build itself when the job starts)."""
    if spec.alloc is not None:
        raise MatrixError(f"{where}.alloc: allocation {spec.alloc} for model {model!r}, which runs engine llama.cpp: "
                          "the program takes one K and one V type; per-layer types run on the torch engine")
    for opt, default in (("compute", CELL_DEFAULTS["compute"]), ("sink", None), ("tail_dtype", None),
                         ("iters", CELL_DEFAULTS["iters"])):
        if getattr(spec, opt) != default:
            raise MatrixError(f"{where}.{opt}: {getattr(spec, opt)!r} for model {model!r}, which runs engine llama.cpp: "
                              f"the program takes its own {opt}; accepted there: types, tail, rot")


def _cell_spec(where: str, flds: dict, k, v, tail, opts: dict, alloc: str | None = None) -> CellSpec:
    """The CellSpec of one config cell; a refused option is a MatrixError naming its config field
    (`flds`: the fields the K type, the V type, the pair and the allocation came from)."""
    try:
        return cell_spec(k, v, tail, alloc=alloc, **opts)
    except CellError as e:
        raise MatrixError(f"{flds.get(e.field, f'{where}.{e.field}')}: {e}") from None


def _normalize(cell: Cell) -> Cell:
    """One path per distinct run: options that cannot change the numbers are dropped.

    KVarN always rotates and iters only matter to KVarN; a tail dtype or sink equal to
    the pair's default is the default (so existing cell paths stay as they were); a tail the
    format rounds is the tail it runs at (`kvarn.vocab.facts.job_tail`: KVarN 500 is the 512 job,
    a tail of 0 stays t0); an allocation of one K and one V type on every layer of any model is
    the plain cell of that pair (bit for bit the same run, tests/test_allocation_cache.py).
    """
    if cell.alloc is not None and allocation.lookup(cell.alloc).uniform:
        cell = replace(cell, alloc=None)
    default_td = facts.pair_default_tail_dtype(cell.k, cell.v)
    own_sink = max(facts.get(cell.k).sink, facts.get(cell.v).sink)
    kvarn = cell.family == "kvarn"
    return replace(cell,
                   tail=facts.job_tail(cell.k, cell.v, cell.tail),
                   sink=None if cell.sink == own_sink else cell.sink,
                   rot=True if kvarn else cell.rot,
                   iters=cell.iters if kvarn else CELL_DEFAULTS["iters"],
                   tail_dtype=None if cell.tail_dtype == default_td else cell.tail_dtype)
