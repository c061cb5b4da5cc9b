"""A cell's identity and its one path encoding, torch-free (DESIGN §7).

A cell is a K type, a V type, a requested tail and the run options that change its numbers
(rotation, the exact copy's dtype, KVarN's normalization passes, a sink, the compute path).
Its directory name is `{k}-{v}-t{tail}{opts}` with the options that differ from the
defaults as path tokens, in one order: `-norot`, `-td{dtype}`, `-i{iters}`, `-s{sink}`,
`-llamacpp_cpu`. `CellSpec.name` writes it and `CellSpec.from_name` reads it back: the
matrix, the workflow's wildcards and the report use these, nothing else parses a cell name.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields

from kvarn.spec.facts import KVARN_ITERS
from kvarn.spec.options import COMPUTES, DEFAULT_COMPUTE

CELL_NAME = "{k}-{v}-t{tail}{opts}"
# Wildcard patterns: a type name has no "-", so a cell name parses one way.
TYPE_PATTERN = r"[a-z0-9_]+"
OPTS_PATTERN = r"(?:-norot|-td[a-z0-9]+|-i[0-9]+|-s[0-9]+|-llamacpp_cpu)*"
_NAME_RE = re.compile(rf"(?P<k>{TYPE_PATTERN})-(?P<v>{TYPE_PATTERN})-t(?P<tail>[0-9]+)(?P<opts>{OPTS_PATTERN})")
_OPT_RE = re.compile(r"-(?:(?P<norot>norot)|td(?P<td>[a-z0-9]+)|i(?P<iters>[0-9]+)|s(?P<sink>[0-9]+)|(?P<cpu>llamacpp_cpu))")


def compute_suffix(compute: str) -> str:
    """The path token of a compute path: '' for exact, '-llamacpp_cpu' for llamacpp-cpu."""
    if compute not in COMPUTES:
        raise ValueError(f"compute {compute!r} is not one of {', '.join(COMPUTES)}")
    return "" if compute == DEFAULT_COMPUTE else "-" + compute.replace("-", "_")


@dataclass(frozen=True)
class CellSpec:
    k: str
    v: str
    tail: int
    rot: bool = True
    tail_dtype: str | None = None  # None: the family's default (bf16 standard, f16 KVarN)
    iters: int = KVARN_ITERS
    sink: int | None = None  # None: the pair's own (0 standard, 128 KVarN)
    compute: str = DEFAULT_COMPUTE  # kvarn.llamacpp.compute: "exact" | "llamacpp-cpu"

    @property
    def opts(self) -> str:
        """The non-default options as path tokens, in their one order."""
        return (("" if self.rot else "-norot")
                + (f"-td{self.tail_dtype}" if self.tail_dtype else "")
                + (f"-i{self.iters}" if self.iters != KVARN_ITERS else "")
                + (f"-s{self.sink}" if self.sink is not None else "")
                + compute_suffix(self.compute))

    @property
    def name(self) -> str:
        """The cell's directory name, `{k}-{v}-t{tail}{opts}`."""
        return CELL_NAME.format(k=self.k, v=self.v, tail=self.tail, opts=self.opts)

    @classmethod
    def from_name(cls, name: str) -> CellSpec:
        """The cell a directory name encodes; a name that `name` would not write is refused."""
        m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"{name!r} is not a cell name; expected {{k}}-{{v}}-t{{tail}}{{opts}}, e.g. "
                             "q4_0-q4_0-t128 or kvarn4-kvarn4-t0-s64 (opts: -norot, -td<dtype>, -i<n>, -s<n>, "
                             "-llamacpp_cpu, in that order)")
        spec = cls(m["k"], m["v"], int(m["tail"]), **parse_opts(m["opts"]))
        if spec.name != name:
            raise ValueError(f"{name!r} is not a cell name as the matrix writes it; the same cell is {spec.name!r}")
        return spec


def parse_opts(opts: str) -> dict:
    """rot, tail_dtype, iters, sink and compute from a cell name's options suffix (defaults where absent)."""
    if not re.fullmatch(OPTS_PATTERN, opts or ""):
        raise ValueError(f"{opts!r} is not a cell's options suffix; expected tokens of -norot, -td<dtype>, -i<n>, "
                         "-s<n>, -llamacpp_cpu")
    out = {f.name: f.default for f in fields(CellSpec) if f.default is not MISSING}  # CellSpec's defaults
    for o in _OPT_RE.finditer(opts or ""):
        if o["norot"]:
            out["rot"] = False
        elif o["td"]:
            out["tail_dtype"] = o["td"]
        elif o["iters"]:
            out["iters"] = int(o["iters"])
        elif o["sink"]:
            out["sink"] = int(o["sink"])
        else:
            out["compute"] = "llamacpp-cpu"
    return out
