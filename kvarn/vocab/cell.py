"""A cell's identity, its one check and its one path encoding, torch-free (DESIGN §7).

A cell is a K type, a V type, a requested tail and the run options that change its numbers
(rotation, the exact copy's dtype, KVarN's normalization passes, a sink, the compute path).
`CellSpec` holds them; constructing one validates every option (`CellSpec.validate`, the
one place each is checked: the CLI, the matrix, the workflow, the engine, the cache,
decode, layer error and memory take a CellSpec instead of re-checking keyword lists).

Its directory name is `{k}-{v}-t{tail}{opts}` with the options that differ from the
defaults as path tokens, in one order: `-a{allocation}`, `-norot`, `-td{dtype}`, `-i{iters}`,
`-s{sink}`, `-llamacpp_cpu`, `-bf16_attn` or `-tf32_attn` (the compute path). `CellSpec.name` writes it and
`CellSpec.from_name` (or `from_wildcards`, the workflow's {k}, {v}, {tail}, {opts}) reads it
back: the matrix, the workflow, the worker's requests and the report use these, nothing else
builds or parses a cell name.

A cell of per-layer types (kvarn.vocab.allocation) is an `AllocCellSpec`: a CellSpec with the
allocation's token (`edges8.1a2b3c4d`: its name and the digest of its definition) in `alloc`,
its K and V the allocation's main types. A plain CellSpec has no `alloc` field (a class
attribute None), so its fields, and the workflow params made of them, are what they were.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

from kvarn.vocab import allocation, facts, policy
from kvarn.vocab.options import COMPUTES, DEFAULT_COMPUTE, LLAMACPP_CPU, check_compute

CELL_NAME = "{k}-{v}-t{tail}{opts}"
# Wildcard patterns: a type name has no "-", so a cell name parses one way.
TYPE_PATTERN = r"[a-z0-9_]+"
OPTS_PATTERN = (r"(?:-a" + allocation.TOKEN_PATTERN
                + r"|-norot|-td[a-z0-9]+|-i[0-9]+|-s[0-9]+|-llamacpp_cpu|-bf16_attn|-tf32_attn)*")
_NAME_RE = re.compile(rf"(?P<k>{TYPE_PATTERN})-(?P<v>{TYPE_PATTERN})-t(?P<tail>[0-9]+)(?P<opts>{OPTS_PATTERN})")
_OPT_RE = re.compile(r"-(?:a(?P<alloc>" + allocation.TOKEN_PATTERN + r")|(?P<norot>norot)|td(?P<td>[a-z0-9]+)"
                     r"|i(?P<iters>[0-9]+)|s(?P<sink>[0-9]+)|(?P<compute>llamacpp_cpu|bf16_attn|tf32_attn))")


class CellError(ValueError):
    """A cell option that `CellSpec.validate` refuses. `field` is the CellSpec field (or
    "pair" for the K/V combination), `value` the value given; the message names the value
    and what is accepted. Entry points prefix their own name for the field (the matrix
    `cells[i].sink`, the CLI `--sink`)."""

    def __init__(self, field: str, value, message: str):
        super().__init__(message)
        self.field, self.value = field, value


def compute_suffix(compute: str) -> str:
    """The path token of a compute path: '' for exact, else '-' and its name with '_' for '-'
    ('-llamacpp_cpu', '-bf16_attn', '-tf32_attn')."""
    if compute not in COMPUTES:
        raise ValueError(f"compute {compute!r} is not one of {', '.join(COMPUTES)}")
    return "" if compute == DEFAULT_COMPUTE else "-" + compute.replace("-", "_")


# A run's baseline dump per compute path (baseline.kvd, baseline-llamacpp_cpu.kvd, ...): the Snakefile's `bopts`.
BASELINE_OPTS_PATTERN = "(" + "|".join(re.escape(compute_suffix(c)) for c in COMPUTES) + ")"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class CellSpec:
    k: str
    v: str
    tail: int
    rot: bool = True
    tail_dtype: str | None = None  # None: the family's default (bf16 standard, f16 KVarN)
    iters: int = facts.KVARN_ITERS  # KVarN's variance-normalization passes
    sink: int | None = None  # None: the pair's own (0 standard, 128 KVarN)
    compute: str = DEFAULT_COMPUTE  # kvarn.vocab.options.COMPUTES: "exact" | "llamacpp-cpu" | "bf16-attn" | "tf32-attn"
    alloc: ClassVar[str | None] = None  # per-layer types: AllocCellSpec's field (the allocation's token)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every check of a cell's options, in one place; a CellError names the value and
        what is accepted. Called on construction, so a CellSpec in hand is a valid one."""
        for role, t in (("k", self.k), ("v", self.v)):
            if not isinstance(t, str) or t not in facts.FACTS:
                raise CellError(role, t, f"{role.upper()} type: unknown KV cache type {t!r}; accepted: "
                                         f"{', '.join(facts.FACTS)}")
        kf, vf = facts.get(self.k), facts.get(self.v)
        try:
            policy.pair_family(kf, vf)
        except ValueError as e:
            raise CellError("pair", f"{self.k}/{self.v}", str(e)) from None
        if not _is_int(self.tail) or self.tail < 0:
            raise CellError("tail", self.tail, f"tail must be an integer >= 0, got {self.tail!r}")
        if not isinstance(self.rot, bool):
            raise CellError("rot", self.rot, f"rot must be true or false, got {self.rot!r}")
        if self.tail_dtype is not None and self.tail_dtype not in facts.TAIL_DTYPES:
            raise CellError("tail_dtype", self.tail_dtype, f"tail_dtype {self.tail_dtype!r} is not accepted; use "
                                                           f"one of {', '.join(facts.TAIL_DTYPES)} (or none: the pair's own)")
        if not _is_int(self.iters) or self.iters < 1:
            raise CellError("iters", self.iters, f"iters must be an integer >= 1 (KVarN's normalization "
                                                 f"passes; default {facts.KVARN_ITERS}), got {self.iters!r}")
        if self.sink is not None:
            own = policy.default_sink(kf, vf)
            if not _is_int(self.sink) or self.sink < 0:
                raise CellError("sink", self.sink, f"sink must be an integer >= 0 (or none: the pair's own, "
                                                   f"{own}), got {self.sink!r}")
            if policy.pair_family(kf, vf) == "kvarn" and self.sink != own:
                raise CellError("sink", self.sink, f"sink {self.sink} for {self.k}/{self.v}: KVarN's sink is fixed at "
                                                   f"{own} (a sink is an option of the standard types only)")
        try:
            check_compute(self.compute, self.k, self.v, self.tail, self.sink)
        except ValueError as e:
            raise CellError("compute", self.compute, str(e)) from None
        if self.alloc is not None or isinstance(self, AllocCellSpec):
            self._check_alloc()

    def _check_alloc(self) -> None:
        """The allocation's token; its main types where this process knows its definition."""
        a = self.alloc
        if not isinstance(a, str) or not allocation.TOKEN_RE.fullmatch(a):
            raise CellError("alloc", a, f"alloc must be an allocation's token, its name and 8 hex digits of its "
                                        f"definition (e.g. edges8.1a2b3c4d), got {a!r}")
        if self.compute == LLAMACPP_CPU:
            raise CellError("compute", self.compute, f"allocation {a} with compute {LLAMACPP_CPU}: per-layer types "
                                                     "are not emulated there (llama.cpp keeps one K and one V type); "
                                                     "use compute exact, bf16-attn or tf32-attn")
        known = allocation.known(a)
        if known is not None and known.base != (self.k, self.v):
            raise CellError("alloc", a, f"allocation {a} has main types {'/'.join(known.base)}: its cells are named "
                                        f"{'-'.join(known.base)}-t..., not {self.k}-{self.v}-t...")

    @property
    def family(self) -> str:
        """The pair's family: 'kvarn', 'ecosystem' or 'standard' (kvarn.vocab.policy.pair_family)."""
        return facts.pair_family(self.k, self.v)

    @property
    def opts(self) -> str:
        """The non-default options as path tokens, in their one order."""
        return ((f"-a{self.alloc}" if self.alloc is not None else "")
                + ("" if self.rot else "-norot")
                + (f"-td{self.tail_dtype}" if self.tail_dtype else "")
                + (f"-i{self.iters}" if self.iters != facts.KVARN_ITERS else "")
                + (f"-s{self.sink}" if self.sink is not None else "")
                + compute_suffix(self.compute))

    @property
    def name(self) -> str:
        """The cell's directory name, `{k}-{v}-t{tail}{opts}`: the one encoding of a cell."""
        return CELL_NAME.format(k=self.k, v=self.v, tail=self.tail, opts=self.opts)

    @classmethod
    def from_name(cls, name: str) -> CellSpec:
        """The cell a directory name encodes; a name that `name` would not write is refused."""
        m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"{name!r} is not a cell name; expected {{k}}-{{v}}-t{{tail}}{{opts}}, e.g. "
                             "q4_0-q4_0-t128 or kvarn4-kvarn4-t0-s64 (opts: -norot, -td<dtype>, -i<n>, -s<n>, "
                             "-llamacpp_cpu, -bf16_attn or -tf32_attn, in that order)")
        try:
            spec = cell_spec(m["k"], m["v"], int(m["tail"]), **parse_opts(m["opts"]))
        except CellError as e:
            raise CellError(e.field, e.value, f"{name!r} is not the cell name of a valid cell: {e}") from None
        if spec.name != name:
            raise ValueError(f"{name!r} is not a cell name as the matrix writes it; the same cell is {spec.name!r}")
        return spec

    @classmethod
    def from_wildcards(cls, wildcards) -> CellSpec:
        """The cell of a workflow job from its path wildcards {k}, {v}, {tail}, {opts} (`from_name`)."""
        return cls.from_name(CELL_NAME.format(k=wildcards.k, v=wildcards.v, tail=wildcards.tail,
                                              opts=wildcards.opts))


@dataclass(frozen=True)
class AllocCellSpec(CellSpec):
    """A cell of per-layer types: `alloc` is its allocation's token (kvarn.vocab.allocation), `k` and
    `v` that allocation's main types; every other option as a CellSpec's, on every layer."""

    alloc: str = field(kw_only=True)


def cell_spec(k: str, v: str, tail: int, alloc: str | None = None, **opts) -> CellSpec:
    """The CellSpec of these fields: an AllocCellSpec when `alloc` names an allocation."""
    return CellSpec(k, v, tail, **opts) if alloc is None else AllocCellSpec(k, v, tail, alloc=alloc, **opts)


def parse_opts(opts: str) -> dict:
    """rot, tail_dtype, iters, sink and compute from a cell name's options suffix (defaults where absent),
    and alloc where it names an allocation."""
    if not re.fullmatch(OPTS_PATTERN, opts or ""):
        if re.search(r"-a[a-z0-9_]*\.", opts or ""):
            raise ValueError(f"{opts!r} is not a cell's options suffix; expected tokens of -a<allocation>.<digest> "
                             "(e.g. -aedges8.1a2b3c4d), -norot, -td<dtype>, -i<n>, -s<n>, -llamacpp_cpu, -bf16_attn "
                             "or -tf32_attn")
        raise ValueError(f"{opts!r} is not a cell's options suffix; expected tokens of -norot, -td<dtype>, -i<n>, "
                         "-s<n>, -llamacpp_cpu, -bf16_attn or -tf32_attn")
    out = {f.name: f.default for f in fields(CellSpec) if f.default is not MISSING}  # CellSpec's defaults
    for o in _OPT_RE.finditer(opts or ""):
        if o["alloc"]:
            out["alloc"] = o["alloc"]
        elif o["norot"]:
            out["rot"] = False
        elif o["td"]:
            out["tail_dtype"] = o["td"]
        elif o["iters"]:
            out["iters"] = int(o["iters"])
        elif o["sink"]:
            out["sink"] = int(o["sink"])
        else:
            out["compute"] = o["compute"].replace("_", "-")
    return out
