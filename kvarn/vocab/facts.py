"""Facts of every KV cache type, torch-free: the one table the rest of kvarn reads.

Owns, per type name: its family, nominal bit width, group (tokens per body write), sink,
effective-tail rule, default tail dtype, numerics version, which head dims it stores and
its packed byte count (hence bits per value at each head dim); and the pair rules built
on them (`pair_family`, `pair_default_tail_dtype`, `pair_effective_tail`, `tail_label`).

The memory accounting (`kvarn.budget.memory`), the matrix (`kvarn.plan.matrix`), the report and the
test fixtures read these facts here instead of re-deriving KVarN's rules. The format
classes (`kvarn.formats`) implement the numerics; `tests/test_facts.py` checks that every
registered format agrees with this table (attributes, head-dim checks, byte counts on
real encoded buffers). The KVarN format reads its constants (group, slice, sink, widths,
iters, tail dtype, version) from this module.

Byte formulas (per head, K or V, `n` tokens, head dim D):

    float  n * D * itemsize                              (f32 4, f16 / bf16 2)
    block  n * D/32 * block_bytes,  block_bytes = 2 * (1 + has_min) + 32 * bits / 8
    kvarnb n/128 whole groups x D/c tiles of ceil(R*C*b/8) + 2*(2R + C) bytes,
           c = min(D, 128) channels per tile; K tile R = c, C = 128; V tile R = 128, C = c
    ecosystem (quantoN, hqqN, kiviN) n/128 whole groups; n * D * bits/8 packed codes
           + 2 * (n * D / q_group) scale/zero values at the library's dtype (bf16: 2 bytes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvarn.vocab import policy

QK = 32  # values per block of the llama.cpp block types
KVARN_GROUP = 128  # tokens per KVarN tile (G)
KVARN_SLICE = 128  # most channels in one KVarN tile; wider heads are cut into slices
KVARN_SINK = 128  # exact leading tokens on full-attention layers (DESIGN §2)
KVARN_WIDTHS = tuple(range(2, 9))  # BeeLlama ships 2..6 and 8; 7 costs nothing
KVARN_ITERS = 16  # variance-normalization passes (DESIGN §4): BeeLlama and the paper-era reference (vLLM now uses 8)
KVARN_DEFAULT_TAIL_DTYPE = "f16"  # KVarN's exact copy (DESIGN §2); the standard types' is bf16
KVARN_VERSION = 2  # KVarN's numerics version (2: BeeLlama's CPU arithmetic: butterfly rotation, F16 stage, float64 stds)

# transformers' QuantizedCache backends as body formats (kvarn.formats.ecosystem). Their numerics
# version is the libraries' versions: each entry pins the two libraries (pyproject.toml and
# envs/kvarn.yaml must agree; a format refuses another installed version and a packed buffer
# records the one that wrote it), so a new pin is a new version, which reruns the cells.
ECOSYSTEM_PINS = {
    1: {"quanto": ("optimum-quanto", "0.2.7"), "hqq": ("hqq", "0.2.8.post1")},
}
ECOSYSTEM_VERSION = max(ECOSYSTEM_PINS)
ECOSYSTEM_LIBRARIES = ECOSYSTEM_PINS[ECOSYSTEM_VERSION]
ECOSYSTEM_GROUP = 128  # tokens per body write = transformers' residual_length (its full-precision window)
ECOSYSTEM_META_DTYPE = "bf16"  # the library's scale/zero dtype = the model's dtype (bf16 as transformers loads these)
# name: (backend, code bits, K axis, V axis, q_group_size), axes as transformers' QuantizedCache takes them:
#   quanto axis 0 / hqq axis 1: per token, groups of q_group_size channels;
#   quanto axis -1: per channel, groups of q_group_size consecutive tokens (KIVI's K)
ECOSYSTEM_TYPES = {
    "quanto4": ("quanto", 4, 0, 0, 64), "quanto2": ("quanto", 2, 0, 0, 64),  # QuantizedCache's defaults
    "hqq4": ("hqq", 4, 1, 1, 64), "hqq2": ("hqq", 2, 1, 1, 64),
    "kivi4": ("quanto", 4, -1, 0, 32), "kivi2": ("quanto", 2, -1, 0, 32),  # KIVI: K per channel, V per token, G 32
}

def kvarn_head_dim_ok(head_dim) -> bool:
    """KVarN tiles need a power-of-two head dim in [64, 512]."""
    return (isinstance(head_dim, int) and not isinstance(head_dim, bool) and 64 <= head_dim <= 512
            and not head_dim & (head_dim - 1))


def kvarn_tile_shape(role: str, head_dim: int) -> tuple[int, int, int]:
    """(rows, cols, tiles per group) of one head's KVarN tiles for K (role 'k') or V ('v')."""
    ch = min(head_dim, KVARN_SLICE)
    rows, cols = (ch, KVARN_GROUP) if role == "k" else (KVARN_GROUP, ch)
    return rows, cols, head_dim // ch


def kvarn_payload_nbytes(rows: int, cols: int, bits: int) -> int:
    """Bytes of one KVarN tile's codes as a dense bitstream."""
    return math.ceil(rows * cols * bits / 8)


def kvarn_tile_nbytes(rows: int, cols: int, bits: int) -> int:
    """Codes (dense bitstream) + fp16 scale[rows] + fp16 zero[rows] + fp16 other[cols]."""
    return kvarn_payload_nbytes(rows, cols, bits) + 2 * (2 * rows + cols)


@dataclass(frozen=True)
class TypeFacts:
    """One KV cache type. Attribute names match `kvarn.formats.KVFormat`'s, so the pair
    rules of `kvarn.vocab.policy` accept either."""

    name: str
    family: str  # "float" | "block" | "kvarn" | "ecosystem"
    bits: int  # nominal bits per value: the code width (16 / 32 for the float types)
    group: int = 1  # tokens that must arrive before the body can be written
    sink: int = 0  # exact leading tokens on full-attention layers
    tail_quantum: int = 1  # effective tail = max(min_tail, roundup(tail, tail_quantum))
    min_tail: int = 0
    default_tail_dtype: str = "bf16"
    version: int = 1  # numerics version: bumping it reruns the cells that use the type
    itemsize: int = 0  # float types: bytes per value
    has_min: bool = False  # block types: an fp16 min per block besides the scale (the _1 types)
    q_group: int = 0  # ecosystem types: values per scale/zero pair (the library's q_group_size)
    meta_itemsize: int = 0  # ecosystem types: bytes of one scale or zero (the library's dtype)
    library: str = ""  # ecosystem types: "dist==version" of the library that quantizes

    @property
    def block_bytes(self) -> int:
        """Block types: bytes per block of 32 values (fp16 scale [+ fp16 min] + codes)."""
        return 2 * (1 + self.has_min) + QK * self.bits // 8

    # --- head dims ---------------------------------------------------------------
    def supported_head_dims(self, rot: bool = True) -> str:
        if self.family == "kvarn":
            return "powers of two 64..512"
        if self.family == "block":
            return "multiples of 64 (Hadamard pre-rotation)" if rot else f"multiples of {QK}"
        if self.family == "ecosystem":
            return f"multiples of {self.q_group}"
        return "any"

    def supports(self, head_dim: int, rot: bool = True) -> bool:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            return False
        if self.family == "kvarn":
            return kvarn_head_dim_ok(head_dim)
        if self.family == "block":
            # the K rotation block is a power of two >= 64 dividing D, the V one is 64
            return head_dim % (64 if rot else QK) == 0
        if self.family == "ecosystem":
            return head_dim % self.q_group == 0
        return True

    def check_head_dim(self, head_dim: int, rot: bool = True) -> None:
        if not self.supports(head_dim, rot):
            raise ValueError(
                f"{self.name}: head dim {head_dim!r} not supported; accepted: {self.supported_head_dims(rot)}"
            )

    # --- bytes -------------------------------------------------------------------
    def tile_shape(self, role: str, head_dim: int) -> tuple[int, int, int]:
        """KVarN: (rows, cols, tiles per group) of one head's K (role 'k') or V ('v') tiles."""
        return kvarn_tile_shape(role, head_dim)

    def nbytes(self, n_tokens: int, head_dim: int, role: str = "k", rot: bool = True) -> int:
        """Bytes of the packed buffer of n_tokens of one head (K or V); KVarN: whole groups only."""
        if role not in ("k", "v"):
            raise ValueError(f"role must be 'k' or 'v', got {role!r}")
        self.check_head_dim(head_dim, rot)
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"{self.name}: n_tokens must be an integer >= 0, got {n_tokens!r}")
        if self.family == "float":
            return n_tokens * head_dim * self.itemsize
        if self.family == "block":
            return n_tokens * (head_dim // QK) * self.block_bytes
        if n_tokens % self.group:
            raise ValueError(f"{self.name}: n_tokens {n_tokens} is not a multiple of the group size {self.group}")
        if self.family == "ecosystem":
            # packed codes + one scale and one zero per q_group values, at the library's dtype
            values = n_tokens * head_dim
            return values * self.bits // 8 + 2 * self.meta_itemsize * (values // self.q_group)
        rows, cols, tiles = self.tile_shape(role, head_dim)
        return n_tokens // self.group * tiles * kvarn_tile_nbytes(rows, cols, self.bits)

    def bits_per_value(self, head_dim: int, role: str = "k", rot: bool = True) -> float:
        """Stored bits per K or V value, metadata included, over one whole group."""
        return 8 * self.nbytes(self.group, head_dim, role, rot) / (self.group * head_dim)

    def effective_tail(self, tail: int) -> int:
        return max(self.min_tail, self.tail_quantum * math.ceil(tail / self.tail_quantum))


def build_table() -> dict[str, TypeFacts]:
    """Every type's facts, built from the tables above (FACTS is this, built once at import), in the
    format registry's order (error messages list the accepted types in it)."""
    rows = [
        TypeFacts(n, "block", bits, has_min=has_min, version=2 if n == "q6_0" else 1)  # q6_0 2: refit order
        for n, bits, has_min in (
            ("q8_0", 8, False), ("q6_0", 6, False), ("q6_1", 6, True), ("q5_1", 5, True), ("q5_0", 5, False),
            ("q4_1", 4, True), ("q4_0", 4, False), ("iq4_nl", 4, False), ("q3_1", 3, True), ("q3_0", 3, False),
            ("q2_1", 2, True), ("q2_0", 2, False),
        )
    ]
    rows += [TypeFacts(n, "float", 8 * size, itemsize=size) for n, size in (("f32", 4), ("f16", 2), ("bf16", 2))]
    rows += [
        TypeFacts(f"kvarn{b}", "kvarn", b, group=KVARN_GROUP, sink=KVARN_SINK, tail_quantum=KVARN_GROUP,
                  min_tail=KVARN_GROUP, default_tail_dtype=KVARN_DEFAULT_TAIL_DTYPE, version=KVARN_VERSION)
        for b in KVARN_WIDTHS
    ]
    meta = {"bf16": 2, "f16": 2, "f32": 4}[ECOSYSTEM_META_DTYPE]
    rows += [
        TypeFacts(n, "ecosystem", bits, group=ECOSYSTEM_GROUP, min_tail=ECOSYSTEM_GROUP, version=ECOSYSTEM_VERSION,
                  q_group=qg, meta_itemsize=meta, library="==".join(ECOSYSTEM_LIBRARIES[backend]))
        for n, (backend, bits, _ak, _av, qg) in ECOSYSTEM_TYPES.items()
    ]
    return {r.name: r for r in rows}


FACTS: dict[str, TypeFacts] = build_table()
TAIL_DTYPES = ("bf16", "f16", "f32")  # the exact copy is one of the float types


def names() -> list[str]:
    return list(FACTS)


def get(name: str) -> TypeFacts:
    """The facts of one type; an unknown name raises ValueError naming it and the accepted ones."""
    if not isinstance(name, str) or name not in FACTS:
        raise ValueError(f"unknown KV cache type {name!r}; accepted: {', '.join(FACTS)}")
    return FACTS[name]


def pair_family(k: str, v: str) -> str:
    """'kvarn' or 'standard'; KVarN cannot be mixed with other types in one cache."""
    return policy.pair_family(get(k), get(v))


def pair_default_tail_dtype(k: str, v: str) -> str:
    return policy.default_tail_dtype(get(k), get(v))


def pair_effective_tail(k: str, v: str, tail: int) -> int:
    """The tail a full-attention layer keeps exact for a requested tail (KVarN: >= 128, whole groups)."""
    return max(get(k).effective_tail(tail), get(v).effective_tail(tail))


def job_tail(k: str, v: str, tail: int) -> int:
    """The tail that names a job for a requested tail: the pair's effective tail where the format
    rounds a request (KVarN: 500 runs at 512, so it is the 512 job), a request of 0 kept as 0 (the
    KVarN cell printed 128*, whose path stays t0)."""
    return tail if tail == 0 else pair_effective_tail(k, v, tail)


def tail_label(k: str, v: str, tail: int) -> str:
    """The tail as tables print it: '128*' where KVarN raised the request to its minimum."""
    return label_tail(tail, pair_effective_tail(k, v, tail))


def label_tail(requested: int, effective: int | None) -> str:
    """'{effective}*' where the format raised the request, else the request (effective None: unknown)."""
    return f"{effective}*" if effective is not None and effective != requested else str(requested)
