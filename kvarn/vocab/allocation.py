"""Per-layer K and V types ("allocations"), torch-free: their two config forms, their checks, the
per-layer map a model gets, the engines' spellings of it, and where a process finds one.

An allocation is named in the config (`allocations:`, config/README.md) and gives every decoder
layer a K type and a V type, per role in one of two forms:

* ranges, the engines' range syntax: ``k: "0-1:q8_0,2-27:q4_0,28-29:q8_0"`` names every decoder
  layer from 0 exactly once (the model's layer count is checked where its geometry is known);
* first/last, ik_llama.cpp's ``-ctk q4_0 -ctk-first q8_0,2 -ctk-last q8_0,2``: ``k: q4_0`` on every
  layer, ``k_first: "q8_0,2"`` on the first N, ``k_last`` on the last N; it fits any model.

Layer indices are decoder-layer indices as llama.cpp and ik_llama.cpp count them (`il`: every
layer, a hybrid model's recurrent layers included), which are transformers' `layer_idx` and
`kvarn.vocab.geometry`'s; a layer without a KV cache takes a type and ignores it, as they do
(docs/notes/per-layer.md). All the types of one allocation are of one family (standard, KVarN or
QuantizedCache types): the cell's tail, sink, tail dtype and group are the family's, the same on
every layer.

Identity: `Allocation.token` is `{name}.{digest}`, the digest 8 hex digits of the sha256 of the
canonical definition. A cell's name carries it (`-a{token}`, kvarn.vocab.cell), so an edited
allocation is another cell path, and a name says which definition it means. Where the layers'
types are needed (the cache, the memory accounting), `lookup` finds the definition: one this
process defined (`define`; the matrix defines the config's), else the file `{token}.json` in the
directory that `DIR_ENV` names (the workflow writes them there, kvarn.plan.allocations.publish_allocations):
content-addressed, so a worker started before an edit reads the new definition, never a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvarn.vocab import facts

NAME_RE = re.compile(r"[a-z0-9_]{1,40}")
DIGITS = 8  # hex digits of the digest in a token
TOKEN_RE = re.compile(r"[a-z0-9_]{1,40}\.[0-9a-f]{8}")
TOKEN_PATTERN = r"[a-z0-9_]+\.[0-9a-f]+"  # a token in a cell name's wildcard (TOKEN_RE checks the lengths)
FIELDS = ("k", "v", "k_first", "k_last", "v_first", "v_last")
DIR_ENV = "KVARN_ALLOCATIONS_DIR"
DEFAULT_DIR = ".snakemake/kvarn-allocations"
RANGES_HELP = "FIRST-LAST:TYPE or LAYER:TYPE items, comma-separated, e.g. 0-1:q8_0,2-27:q4_0,28-29:q8_0"
EDGE_HELP = "TYPE,N as ik_llama.cpp's -ctk-first takes it, e.g. q8_0,2"
FAMILY_WORDS = {"standard": "a standard type", "kvarn": "KVarN", "ecosystem": "a QuantizedCache type"}
_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?:([a-z0-9_]+)")
_EDGE_RE = re.compile(r"([a-z0-9_]+),(\d+)")


class AllocationError(ValueError):
    """An allocation refused: the message starts with where it is (`allocations.edges8.k`) and
    names the layer or the value, and what is accepted."""


def layers_text(a: int, b: int) -> str:
    """'layer 3' or 'layers 3-5'."""
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def family(t: str) -> str:
    """'standard', 'kvarn' or 'ecosystem': the family whose tail, sink and group rules a type follows."""
    f = facts.get(t).family
    return f if f in ("kvarn", "ecosystem") else "standard"


def runs_of(types: Sequence[str]) -> list[tuple[int, int, str]]:
    """(first, last, type) of each run of one type in a per-layer list."""
    out: list[tuple[int, int, str]] = []
    for i, t in enumerate(types):
        if out and out[-1][2] == t:
            out[-1] = (out[-1][0], i, t)
        else:
            out.append((i, i, t))
    return out


def range_string(types: Sequence[str]) -> str:
    """A per-layer list in the range form: '0-1:q8_0,2-27:q4_0,28-29:q8_0'."""
    return ",".join(f"{a}:{t}" if a == b else f"{a}-{b}:{t}" for a, b, t in runs_of(types))


def _type(where: str, t, layers: str = "") -> str:
    if not isinstance(t, str) or t not in facts.FACTS:
        raise AllocationError(f"{where}: unknown KV cache type {t!r}{' for ' + layers if layers else ''}; "
                              f"accepted: {', '.join(facts.FACTS)}")
    return t


@dataclass(frozen=True)
class Layers:
    """One role's types by decoder layer, as defined: `runs` ((first, last, type), ...), merged,
    covering layers 0.. once in order (the range form); or `base` on every layer with `first` /
    `last` = (type, N) on the first / last N layers (the first/last form; None: no edge)."""

    runs: tuple[tuple[int, int, str], ...] = ()
    base: str | None = None
    first: tuple[str, int] | None = None
    last: tuple[str, int] | None = None

    @classmethod
    def parse(cls, where: str, text, first=None, last=None) -> Layers:
        """One role from the config: `text` ranges or one type, `first` / `last` 'TYPE,N' edges."""
        if not isinstance(text, str) or not text.strip():
            raise AllocationError(f"{where}: {text!r}; give one type for every layer (e.g. q4_0) or ranges "
                                  f"({RANGES_HELP})")
        text = text.replace(" ", "")
        if ":" not in text:
            base = _type(where, text)
            return cls(base=base, first=_edge(f"{where}_first", first, base), last=_edge(f"{where}_last", last, base))
        for which, edge in (("first", first), ("last", last)):
            if edge is not None:
                raise AllocationError(f"{where}_{which}: {edge!r} needs one base type in {where.rsplit('.', 1)[-1]}, "
                                      f"which gives ranges ({text!r}); name those layers in the ranges instead")
        return cls(runs=_ranges(where, text))

    @property
    def text(self) -> str:
        """The ranges, or the base type: the role's config value, canonical."""
        return ",".join(f"{a}:{t}" if a == b else f"{a}-{b}:{t}" for a, b, t in self.runs) or self.base

    def edge(self, which: str) -> str | None:
        """The 'TYPE,N' of an edge ('first' or 'last'), None where there is none."""
        e = getattr(self, which)
        return None if e is None else f"{e[0]},{e[1]}"

    def named(self) -> list[tuple[str, str]]:
        """(type, what it covers) of each part of the definition, in order."""
        if self.runs:
            return [(t, layers_text(a, b)) for a, b, t in self.runs]
        return [(self.base, "every layer")] + [(e[0], f"the {w} {e[1]}") for w, e in
                                               (("first", self.first), ("last", self.last)) if e]

    def types(self) -> list[str]:
        return list(dict.fromkeys(t for t, _ in self.named()))

    @property
    def main(self) -> str:
        """The type a cell's name shows: the base, or the type of the most layers (ties: the first)."""
        if not self.runs:
            return self.base
        count: dict[str, int] = {}
        for a, b, t in self.runs:
            count[t] = count.get(t, 0) + b - a + 1
        return max(count, key=count.get)

    def resolve(self, where: str, n_layers: int) -> tuple[str, ...]:
        """The type of each of a model's `n_layers` decoder layers; a layer past the model, one not
        named or one named twice by the edges is refused, naming it."""
        last = f"0-{n_layers - 1}"
        if self.runs:
            end = self.runs[-1][1] + 1
            if end > n_layers:
                raise AllocationError(f"{where}: layer {n_layers} is past the model, which has {n_layers} decoder "
                                      f"layers ({last}); the ranges {self.text!r} name layers 0-{end - 1}")
            if end < n_layers:
                raise AllocationError(f"{where}: {layers_text(end, n_layers - 1)} of the model's {n_layers} decoder "
                                      f"layers ({last}) {'is' if end == n_layers - 1 else 'are'} not named; the "
                                      f"ranges {self.text!r} end at layer {end - 1}")
            return tuple(t for a, b, t in self.runs for _ in range(a, b + 1))
        nf, nl = (self.first[1] if self.first else 0), (self.last[1] if self.last else 0)
        for which, n in (("first", nf), ("last", nl)):
            if n > n_layers:
                raise AllocationError(f"{where}_{which}: {n} layers: layer {n_layers} is past the model, which has "
                                      f"{n_layers} decoder layers ({last})")
        if nf + nl > n_layers:
            j = n_layers - nl
            raise AllocationError(f"{where}: layer {j} is named twice on the model's {n_layers} decoder layers: by "
                                  f"{where.rsplit('.', 1)[-1]}_first (layers 0-{nf - 1}) and "
                                  f"{where.rsplit('.', 1)[-1]}_last ({layers_text(j, n_layers - 1)})")
        first, last = (self.first or (self.base, 0))[0], (self.last or (self.base, 0))[0]
        return (first,) * nf + (self.base,) * (n_layers - nf - nl) + (last,) * nl


def _edge(where: str, raw, base: str) -> tuple[str, int] | None:
    """A first/last edge 'TYPE,N'; None when absent, of N = 0 or of the base type (no edge at all)."""
    if raw is None:
        return None
    m = _EDGE_RE.fullmatch(raw.replace(" ", "")) if isinstance(raw, str) else None
    if m is None:
        raise AllocationError(f"{where}: {raw!r} is not {EDGE_HELP}")
    t, n = _type(where, m[1]), int(m[2])
    return None if n == 0 or t == base else (t, n)


def _ranges(where: str, text: str) -> tuple[tuple[int, int, str], ...]:
    """The merged runs of a range string that names every layer from 0 once, in any order."""
    items = []
    for part in text.split(","):
        m = _RANGE_RE.fullmatch(part)
        if m is None:
            raise AllocationError(f"{where}: {part!r} is not a range; write {RANGES_HELP}")
        a, b = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if b < a:
            raise AllocationError(f"{where}: {part!r} runs backwards; write the lower layer first ({b}-{a}:{m[3]})")
        items.append((a, b, _type(where, m[3], layers_text(a, b)), part))
    items.sort()
    nxt, prev = 0, None
    for a, b, _, part in items:
        if a > nxt:
            where_gap = f"between {prev!r} and {part!r}" if prev else f"the ranges start at {part!r}"
            raise AllocationError(f"{where}: {layers_text(nxt, a - 1)} {'is' if a - 1 == nxt else 'are'} not named "
                                  f"({where_gap}); name every decoder layer from 0 once")
        if a < nxt:
            raise AllocationError(f"{where}: layer {a} is named twice ({prev!r} and {part!r}); name every decoder "
                                  "layer once")
        nxt, prev = b + 1, part
    return tuple(runs_of([t for a, b, t, _ in items for _ in range(a, b + 1)]))


@dataclass(frozen=True)
class Allocation:
    """A named allocation: the K and the V `Layers`. Built by `parse` (the config's mapping) or
    `from_record` (what a summary.json or a published file holds), checked either way."""

    name: str
    k: Layers
    v: Layers

    @classmethod
    def parse(cls, name, raw, where: str | None = None) -> Allocation:
        """An allocation from its config entry `{k, v, k_first, k_last, v_first, v_last}`."""
        where = where or f"allocations.{name}"
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise AllocationError(f"{where}: allocation name {name!r}; use 1 to 40 of a-z, 0-9 and '_' (a cell "
                                  "name's '-' separates its options)")
        if not isinstance(raw, Mapping) or set(raw) - set(FIELDS) or not {"k", "v"} <= set(raw):
            extra = sorted(set(raw) - set(FIELDS)) if isinstance(raw, Mapping) else []
            what = f"unknown field {', '.join(map(repr, extra))}" if extra else f"{raw!r}"
            raise AllocationError(f"{where}: {what}; give k and v (ranges or one type each) and any of "
                                  "k_first, k_last, v_first, v_last; accepted: " + ", ".join(FIELDS))
        out = cls(name, *(Layers.parse(f"{where}.{r}", raw[r], raw.get(f"{r}_first"), raw.get(f"{r}_last"))
                          for r in ("k", "v")))
        out.check_family(where)
        return out

    @classmethod
    def from_record(cls, record, where: str = "allocation") -> Allocation:
        """The allocation of a `record()` (a summary.json's `kv_alloc`, a published file), its token checked."""
        if not isinstance(record, Mapping) or not {"name", "token", "definition"} <= set(record):
            raise AllocationError(f"{where}: {record!r} is not an allocation record (name, token, definition)")
        out = cls.parse(record["name"], record["definition"], where)
        if out.token != record["token"]:
            raise AllocationError(f"{where}: the definition's token is {out.token}, the record says {record['token']}")
        return out

    def check_family(self, where: str) -> None:
        """All the types of one family, or an AllocationError naming a type of each family found."""
        seen: dict[str, str] = {}
        for role, lay in (("k", self.k), ("v", self.v)):
            for t, what in lay.named():
                seen.setdefault(family(t), f"{t} ({role}, {what})")
        if len(seen) > 1:
            parts = "; ".join(f"{t} is {FAMILY_WORDS[f]}" for f, t in seen.items())
            raise AllocationError(f"{where}: mixes families: {parts}. The layers of one allocation take all standard "
                                  "types, all KVarN or all QuantizedCache types (each family has its own tail, sink "
                                  "and group rules)")

    def definition(self) -> dict:
        """The canonical config entry (the digest's input)."""
        out = {}
        for r, lay in (("k", self.k), ("v", self.v)):
            out[r] = lay.text
            for which in ("first", "last"):
                if lay.edge(which):
                    out[f"{r}_{which}"] = lay.edge(which)
        return out

    @property
    def digest(self) -> str:
        text = json.dumps(self.definition(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:DIGITS]

    @property
    def token(self) -> str:
        """`{name}.{digest}`: what a cell's name carries (`-a{token}`)."""
        return f"{self.name}.{self.digest}"

    @property
    def base(self) -> tuple[str, str]:
        """(K, V) main types: the types a cell's name shows (`Layers.main`)."""
        return self.k.main, self.v.main

    @property
    def family(self) -> str:
        return family(self.k.main)

    @property
    def uniform(self) -> bool:
        """One K type and one V type on every layer of any model (first/last form, no edge)."""
        return all(not lay.runs and lay.first is None and lay.last is None for lay in (self.k, self.v))

    def record(self) -> dict:
        """What a summary.json and a published file hold: name, token and definition."""
        return {"name": self.name, "token": self.token, "definition": self.definition()}

    def resolve(self, n_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(K types, V types) of each of a model's `n_layers` decoder layers (`Layers.resolve`)."""
        where = f"allocations.{self.name}"
        return self.k.resolve(f"{where}.k", n_layers), self.v.resolve(f"{where}.v", n_layers)


# ----------------------------------------------------------------------------- where a token is defined

_KNOWN: dict[str, Allocation] = {}


def define(alloc: Allocation) -> Allocation:
    """Make `alloc` known to this process by its token (content-addressed: a token is one definition)."""
    _KNOWN[alloc.token] = alloc
    return alloc


def known(token: str) -> Allocation | None:
    """The allocation of `token` if this process has defined or looked it up, else None (no I/O)."""
    return _KNOWN.get(token)


def directory() -> Path:
    """Where published definitions are: $KVARN_ALLOCATIONS_DIR, else .snakemake/kvarn-allocations here."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


def lookup(token: str) -> Allocation:
    """The allocation a cell's token names: defined in this process, or published as
    `directory()/{token}.json` (its content checked against the token)."""
    if token in _KNOWN:
        return _KNOWN[token]
    path = directory() / f"{token}.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise AllocationError(
            f"allocation {token!r} is not defined here: this process has not defined it and {path} does not "
            "exist (the workflow writes the config's allocations there when it plans; elsewhere define it first)"
        ) from None
    alloc = Allocation.from_record(record, str(path))
    if alloc.token != token:
        raise AllocationError(f"{path}: holds allocation {alloc.token}, not {token}")
    return define(alloc)


def layer_types(cell, geom, alloc: Allocation | None = None) -> list[tuple[str, str]]:
    """(K type, V type) of each decoder layer of `geom` (kvarn.vocab.geometry.Geometry) for `cell`
    (a kvarn.vocab.cell.CellSpec): its pair on every layer, or its allocation's map (`alloc`, else
    `lookup(cell.alloc)`), whose main types must be the cell's."""
    token = getattr(cell, "alloc", None)
    if token is None:
        return [(cell.k, cell.v)] * geom.n_layers
    alloc = lookup(token) if alloc is None else alloc
    if alloc.token != token:
        raise AllocationError(f"cell {cell.name}: given allocation {alloc.token}, not its own {token}")
    if alloc.base != (cell.k, cell.v):
        raise AllocationError(f"cell {cell.name}: allocation {token} has main types {'/'.join(alloc.base)}, not "
                              f"{cell.k}/{cell.v}")
    return list(zip(*alloc.resolve(geom.n_layers)))


# ----------------------------------------------------------------------------- the engines' spellings

def ik_llama_args(k_types: Sequence[str], v_types: Sequence[str]) -> list[str]:
    """ik_llama.cpp's flags for per-layer lists: -ctk/-ctv the base, -ctk-first/-ctk-last (and V's)
    'TYPE,N' edges. A role of more than a first run, a base and a last run, or of a type that is not
    llama.cpp's family, is refused, naming the layer or the type."""
    args, edges = [], []
    for role, flag, types in (("k", "-ctk", k_types), ("v", "-ctv", v_types)):
        for t in dict.fromkeys(types):
            if family(t) != "standard":
                raise ValueError(f"{role}: {t} is {FAMILY_WORDS[family(t)]}, not a llama.cpp cache type")
        runs = runs_of(types)
        if len(runs) > 3:
            a, _, t = runs[2]
            raise ValueError(f"{role}: {range_string(types)!r} is not a first run, a base and a last run: layer {a} "
                             f"({t}) starts another run; {flag}-first / {flag}-last cannot express it")
        if len(runs) == 2:  # the longer run is the base (ties: the second)
            first, base, last = (runs[0], runs[1], None) if runs[1][1] - runs[1][0] >= runs[0][1] - runs[0][0] \
                else (None, runs[0], runs[1])
        else:
            first, base, last = (runs[0], runs[1], runs[2]) if len(runs) == 3 else (None, runs[0], None)
        args += [flag, base[2]]
        for which, run in (("first", first), ("last", last)):
            if run:
                edges += [f"{flag}-{which}", f"{run[2]},{run[1] - run[0] + 1}"]
    return args + edges


def export(alloc: Allocation, n_layers: int) -> dict:
    """An allocation on a model of `n_layers` decoder layers, as engines take it: `per_layer` (K and V
    lists), `ranges` (the FIRST-LAST:TYPE strings), `ik_llama_cpp` (flags, or None where the first/last
    form cannot express it, `ik_llama_cpp_refused` saying why)."""
    ks, vs = alloc.resolve(n_layers)
    try:
        ik, why = ik_llama_args(ks, vs), None
    except ValueError as e:
        ik, why = None, str(e)
    return {"per_layer": {"k": list(ks), "v": list(vs)}, "ranges": {"k": range_string(ks), "v": range_string(vs)},
            "ik_llama_cpp": ik, "ik_llama_cpp_refused": why}
