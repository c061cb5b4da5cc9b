"""The `perlayer:` config key read into jobs and paths (torch-free: `snakemake -n` imports it).

    perlayer:
      text: ../shared/data/wikitext-2-raw-v1/wiki.valid.raw   # the search's text: Wikitext-2 valid
      n_ctx: 512          # the search's context and chunks (sensitivity and first/last choice)
      chunks: 1
      tail: 128           # standard types' tail; KVarN types run at tail 0, their 128* (the same 128 rows)
      types: {standard: [q8_0, q4_0, q2_0], kvarn: [kvarn8, kvarn4, kvarn3, kvarn2]}
      budgets: [q4_0, kvarn4, kvarn3, kvarn2]   # a uniform cell's bytes, at the model's n_ctx
      edge: {standard: q8_0, kvarn: kvarn8}     # the first/last form's edge type per family

The search reads the validation split only; every allocation it picks is judged on the matrix's
text (the test split) as one more cell of each model's run (`n_ctx[0]`, its chunks). The uniform
cells the table compares against (every K/V pair of each family's types at the family's tail) are
added to the matrix (`uniform_cells`), so the comparison never depends on which cells a config lists.
Every error names the key, the value and what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvarn.vocab import facts

OUT_DIR = "results/perlayer"
SENSITIVITY_FILE = OUT_DIR + "/{model}/sensitivity/{type}.parquet"
SEARCH_FILE = OUT_DIR + "/{model}/search/{budget}.json"
TABLE_FILES = {"md": OUT_DIR + "/perlayer.md", "parquet": OUT_DIR + "/perlayer.parquet"}
HEATMAP = OUT_DIR + "/figures/{model}-sensitivity"
SEARCH_TEXT = "resources/data/wiki.valid.raw"
FAMILIES = ("standard", "kvarn")
DEFAULTS = {"text": None, "n_ctx": 512, "chunks": 1, "tail": 128,
            "types": {"standard": ["q8_0", "q4_0", "q2_0"], "kvarn": ["kvarn8", "kvarn4", "kvarn3", "kvarn2"]},
            "budgets": ["q4_0", "kvarn4", "kvarn3", "kvarn2"], "edge": {"standard": "q8_0", "kvarn": "kvarn8"}}


class PerLayerError(ValueError):
    """A `perlayer:` value refused; the message starts with where it is."""


@dataclass(frozen=True)
class PerLayer:
    text: str | None
    n_ctx: int
    chunks: int
    tail: int
    types: dict[str, tuple[str, ...]]  # family -> types, most bits first
    budgets: tuple[str, ...]
    edge: dict[str, str]

    def family_tail(self, family: str) -> int:
        """The requested tail of a family's cells: `tail` for standard types, 0 for KVarN (its 128*)."""
        return 0 if family == "kvarn" else self.tail

    def tail_of(self, type_name: str) -> int:
        return self.family_tail(family_of(type_name))

    def all_types(self) -> list[str]:
        return [t for f in FAMILIES for t in self.types[f]]

    def uniform_pairs(self) -> list[tuple[str, str, int]]:
        """(K, V, tail) of every pair within each family: the uniform cells the table compares against."""
        return [(k, v, self.family_tail(f)) for f in FAMILIES for k in self.types[f] for v in self.types[f]]

    def sensitivity_files(self, model: str) -> list[str]:
        return [SENSITIVITY_FILE.format(model=model, type=t) for t in self.all_types()]


def family_of(type_name: str) -> str:
    return "kvarn" if facts.get(type_name).family == "kvarn" else "standard"


def _int(where: str, x, lo: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise PerLayerError(f"{where}: {x!r} is not an integer >= {lo}")
    return x


def _type(where: str, t) -> str:
    if not isinstance(t, str) or t not in facts.names():
        raise PerLayerError(f"{where}: unknown type {t!r}; accepted: {', '.join(facts.names())}")
    fam = facts.get(t).family
    if fam not in ("block", "kvarn"):
        raise PerLayerError(f"{where}: {t} is a {fam} type; the search takes standard block types (q8_0, q4_0, ...) "
                            "and KVarN types (kvarn8, kvarn4, ...)")
    return t


def expand(config: dict) -> PerLayer | None:
    """The checked plan of `config['perlayer']`, or None when the config has none."""
    raw = config.get("perlayer")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise PerLayerError(f"perlayer: expected a mapping of {', '.join(DEFAULTS)}, got {raw!r}")
    unknown = set(raw) - set(DEFAULTS)
    if unknown:
        raise PerLayerError(f"perlayer: unknown key(s) {', '.join(sorted(unknown))}; accepted: {', '.join(DEFAULTS)}")
    c = {**DEFAULTS, **raw}
    n_ctx = _int("perlayer.n_ctx", c["n_ctx"], 4)
    if n_ctx % 2:
        raise PerLayerError(f"perlayer.n_ctx: {n_ctx} must be even (the scored half of a chunk)")
    types = {}
    given = c["types"]
    if not isinstance(given, dict) or set(given) - set(FAMILIES):
        raise PerLayerError(f"perlayer.types: expected a mapping of {' and '.join(FAMILIES)} to type lists, got {given!r}")
    for fam in FAMILIES:
        ts = [_type(f"perlayer.types.{fam}", t) for t in given.get(fam, DEFAULTS["types"][fam])]
        wrong = [t for t in ts if family_of(t) != fam]
        if wrong or len(ts) < 2 or len(set(ts)) != len(ts):
            raise PerLayerError(f"perlayer.types.{fam}: {ts!r}; give at least two distinct {fam} types"
                                + (f" ({', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not)" if wrong else ""))
        types[fam] = tuple(sorted(ts, key=lambda t: -facts.get(t).bits))
    budgets = tuple(_type("perlayer.budgets", b) for b in c["budgets"])
    for b in budgets:
        if b not in types[family_of(b)]:
            raise PerLayerError(f"perlayer.budgets: {b} is not among perlayer.types.{family_of(b)} ({', '.join(types[family_of(b)])}); "
                                "a budget is the bytes of one of the searched types' uniform cells")
    edge = {**DEFAULTS["edge"], **(c["edge"] or {})}
    for fam in FAMILIES:
        if _type(f"perlayer.edge.{fam}", edge[fam]) not in types[fam]:
            raise PerLayerError(f"perlayer.edge.{fam}: {edge[fam]} is not among perlayer.types.{fam} ({', '.join(types[fam])})")
    return PerLayer(text=c["text"], n_ctx=n_ctx, chunks=_int("perlayer.chunks", c["chunks"], 1),
                    tail=_int("perlayer.tail", c["tail"], 0), types=types, budgets=budgets, edge=edge)


def with_uniform_cells(config: dict, plan: PerLayer | None, models: list[str]) -> dict:
    """`config` with the uniform cells the table compares against added to its `cells` (every K/V pair
    within each family at the family's tail, on `models`: the torch engine's); unchanged without a plan."""
    if plan is None or not models:
        return config
    groups = [{"k": list(plan.types[f]), "v": list(plan.types[f]), "tail": plan.family_tail(f), "models": models}
              for f in FAMILIES]
    return {**config, "cells": list(config.get("cells") or []) + groups}
