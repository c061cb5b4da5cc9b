"""The KV cache model of DESIGN §2 as a transformers `Cache`: per layer an exact and a body copy.

Owns `KVarnCache` (one model, one cell; its attention layers are `KVarnLayer`s, its
linear-attention layers transformers' own state layers, built from
`kvarn.vocab.geometry.geometry_from_config`), the DESIGN §2 selection (`reads_exact`, and
`exact_selection` over a call's keys), the check that no query reads KVarN's incomplete group
(`check_body_rows`), `make_format` and the per-layer sensitivity's cache (`probe_cache`).
Which copy a (query, key) pair reads is applied in `kvarn.kvcache.attention`.

Why (the two copies, the tail dtype, KVarN's 128-token groups written once complete, the
sliding layers' rows, per-layer types): docs/notes/engine.md "Design", docs/notes/scale.md
"Cache storage", DESIGN §2.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

import kvarn.llamacpp_cpu.compute as kcompute
from kvarn.llamacpp_cpu.channel_order import gguf_order, gguf_qk_permuted
from kvarn.vocab.allocation import layer_types
from kvarn.vocab.cell import CellSpec
from kvarn.formats import get_format
from kvarn.formats.base import ValueRangeError, check_finite
from kvarn.formats.floats import FLOAT_DTYPES
from kvarn.formats.hadamard import rotate_blocks
from kvarn.vocab.geometry import Geometry, geometry_from_config, text_config
from kvarn.vocab.options import ATTENTION_PATHS, ATTENTION_ROUNDING, BEELLAMA_KVARN_HEAD_DIMS, EXACT, LLAMACPP_CPU, scalar_route
from kvarn.vocab.policy import LayerPolicy, default_tail_dtype, layer_policy
from kvarn.kvcache.rows import Rows

def reads_exact(p, j, sink, tail):
    """DESIGN §2 elementwise: the query at position p reads key position j from the exact copy
    iff j < sink or p - j < tail. p, j (and sink, tail) are ints or broadcastable tensors:
    the one rule behind `exact_selection` and the flex path's mask_mod (`kvarn.kvcache.flex`)."""
    return (j < sink) | (p - j < tail)


def exact_selection(q_pos: torch.Tensor, kv_len: int, policy: LayerPolicy, kv_offset: int = 0) -> torch.Tensor:
    """bool [n_queries, kv_len]: True where the query at q_pos reads key j from the exact copy.

    Keys j = kv_offset .. kv_offset + kv_len - 1 (`reads_exact`). Causality and the sliding
    window are not applied here; the attention mask does that (the selection only picks
    the copy).
    """
    j = torch.arange(kv_offset, kv_offset + kv_len, device=q_pos.device)
    return reads_exact(q_pos[:, None], j[None, :], policy.sink, policy.tail)


def make_format(name: str, role: str, rot: bool, iters: int):
    """get_format, passing `iters` only to the formats that take it (KVarN)."""
    fmt = get_format(name, role=role, rot=rot)
    if fmt.family == "kvarn":
        fmt = get_format(name, role=role, rot=rot, iters=iters)
    return fmt


def check_body_rows(module, layer, body_end: int) -> None:
    """A query may read body rows only below `layer.n_body` (`body_end`: one past the last
    body position some query of the call reads): KVarN's incomplete group is zeros."""
    if body_end > layer.n_body:
        raise AssertionError(
            f"layer {module.layer_idx}: a query reads body rows {layer.n_body}..{body_end - 1} of an incomplete "
            f"{layer.group}-token group; the tail ({layer.policy.tail}) must cover them"
        )


class KVarnLayer(CacheLayerMixin):
    """One decoder layer's cache: exact and body copies of K and V, [batch, kv_heads, ·, head_dim].

    Stored in preallocated `kvarn.kvcache.rows.Rows` buffers: the exact copy in the tail dtype
    (its values are that dtype's, so widening a span to fp32 when attention reads it is
    exact), the body in fp32 (a dequantized q4_0 value d·q, d an f16 scale, needs up to 14
    significant bits, more than bf16 or f16 hold; a rotated block needs all of fp32's), or
    in the type's own dtype for the float types (bf16 / f16 bodies are those dtypes'
    values). A sliding-window layer keeps only the rows a query can still read
    (`first_readable`); `keys`, `values`, `exact_keys`, `exact_values` are views of the
    rows the ubatch being processed reads, positions `kv_offset` .. `n_tokens` - 1.
    """

    is_compileable = False
    is_croppable = False
    trim = True  # sliding layers forget keys no query can read (False: keep all, the tests' reference)

    def __init__(self, k_fmt, v_fmt, policy: LayerPolicy, tail_dtype: torch.dtype, layer_idx: int = 0,
                 compute: str = "exact", qk_gguf_order: bool = False, exact_rotation: dict | None = None,
                 attn_rounding: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.k_fmt, self.v_fmt, self.policy, self.tail_dtype = k_fmt, v_fmt, policy, tail_dtype
        # "llamacpp-cpu": the layer keeps what ggml's kernel reads instead (kvarn.llamacpp_cpu.compute),
        # with Q and K in the GGUF's channel order when `qk_gguf_order` (llama arch)
        self.compute = compute
        self.qk_gguf_order = qk_gguf_order
        # {"k": block | None, "v": block | None}: the exact copy rounded in the rotated frame
        # (`_exact_copy`; BeeLlama's scalar route over a rotated standard cache), else None
        self.exact_rotation = exact_rotation or {"k": None, "v": None}
        # compute bf16-attn / tf32-attn: the format attention rounds every K and V to before use
        # (kvarn.vocab.options.ATTENTION_ROUNDING); a bf16 body is stored so (`_body_dtype`)
        self.attn_rounding = attn_rounding
        self.k_op = self.v_op = None
        self.is_sliding = policy.window is not None
        if k_fmt.group != v_fmt.group and "float" not in (k_fmt.family, v_fmt.family):
            raise ValueError(f"K type {k_fmt.name} and V type {v_fmt.name} have different group sizes")
        # a float role beside a grouped one (`probe_cache`) is written per group too: rounding is per value
        self.group = max(k_fmt.group, v_fmt.group)
        # The exact copy is needed when some query reads it, or as KVarN's staging group.
        self.keep_exact = policy.sink > 0 or policy.tail > 0 or self.group > 1
        self.exact_keys = self.exact_values = None
        self.n_ctx = 0  # tokens the chunk will have, when known (`KVarnCache.reserve`): the buffers' size
        self.n_tokens = 0
        self.n_body = 0  # tokens whose body copy has been written
        self.q_offset = 0  # position of the first query of the ubatch being processed
        self.kv_offset = 0  # position of the first key row the ubatch's attention reads
        self.rows: dict[str, Rows] = {}

    narrow_body = True  # under bf16 rounding store the body in bf16 (False: the format's own, the tests' reference)

    def _body_dtype(self, fmt) -> torch.dtype:
        """The body's storage: the float types' own dtype (their values are that dtype's), fp32 for
        the quantized types (a dequantized value, a 16-bit scale times a code, or KVarN's rotated
        back, needs more than 16 bits). Under compute bf16-attn, bf16: attention rounds the body
        to it before every use, so storing it rounded loses nothing (the same rounding). TF32 is
        no storage dtype: under tf32-attn the body stays the format's own."""
        if self.attn_rounding == "bfloat16" and self.narrow_body:
            return torch.bfloat16
        return FLOAT_DTYPES[fmt.name] if fmt.family == "float" else torch.float32

    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d), dtype=torch.float32)
        self.keys = self.values = empty
        self.exact_keys = self.exact_values = empty
        self.device = key_states.device
        self.is_initialized = True
        if self.compute != "exact":
            return
        # Rows a ubatch's attention can read: all on a full layer; on a sliding layer the
        # W - 1 keys before its first query and its own (and KVarN's incomplete group, up
        # to group - 1 rows, should a window be shorter than a group).
        u = key_states.shape[-2]
        hint = self.n_ctx if not self.is_sliding or not self.trim else max(self.policy.window, self.group) - 1 + u
        if self.n_ctx:
            hint = min(hint, self.n_ctx)
        self.rows = {"k": Rows(self._body_dtype(self.k_fmt), hint), "v": Rows(self._body_dtype(self.v_fmt), hint)}
        if self.keep_exact:
            # rows rounded in the rotated frame and rotated back are fp32 values, no longer the tail dtype's
            self.rows.update(**{f"e{r}": Rows(torch.float32 if self.exact_rotation[r] else self.tail_dtype, hint)
                                for r in ("k", "v")})

    def _checked(self, what: str, offset: int, fn, *args) -> torch.Tensor:
        """fn(*args), a finite [b, H, n, D] tensor; a value that cannot be stored, or a
        non-finite result, is a ValueError naming layer, K/V, head and absolute token."""
        try:
            return check_finite(what, fn(*args), "the value")
        except ValueRangeError as e:
            raise ValueError(f"{e.where(self.layer_idx, offset, what)}: {e.detail} [{e.name}]") from None

    def _exact_copy(self, role: str):
        """The exact copy of K or V rows: the tail dtype's values. Over a rotated standard cache on
        BeeLlama's scalar route (`exact_rotation`), the tail dtype's rounding of the rotated rows
        (in the GGUF's channel order for a llama-arch K), rotated back in fp32: llama.cpp rotates
        K and V before its cache stores them, the exact copy included."""
        block = self.exact_rotation[role]
        if block is None:
            return lambda x: x.to(self.tail_dtype)

        def rounded_rotated(x):
            return rotate_blocks(rotate_blocks(x, block).to(self.tail_dtype).float(), block)

        return (lambda x: self._in_k_order(rounded_rotated, x)) if role == "k" else rounded_rotated

    def _k_roundtrip(self, k: torch.Tensor) -> torch.Tensor:
        """K's body rows, rounded in the channel order llama.cpp's blocks see (`_in_k_order`)."""
        return self._in_k_order(self.k_fmt.roundtrip, k)

    def _in_k_order(self, fn, k: torch.Tensor) -> torch.Tensor:
        """fn(k) in transformers' channel order, or (`qk_gguf_order`, BeeLlama's scalar route on a
        llama-arch model) applied in the GGUF's order and gathered back (the scores do not depend
        on a common order of Q and K)."""
        if not self.qk_gguf_order:
            return fn(k)
        order = gguf_order(k.shape[-1], k.device)
        return fn(k[..., order].contiguous())[..., torch.argsort(order)]

    def first_readable(self, q_offset: int) -> int:
        """The first key position a query at >= q_offset can read (0 on a full layer)."""
        if not self.is_sliding or not self.trim or self.compute != "exact":
            return 0
        return max(0, q_offset - self.policy.window + 1)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store a ubatch's post-RoPE K and V; return the body rows its attention reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = key_states.float()
        v = value_states.float()
        self.q_offset = off = self.n_tokens
        n_new = k.shape[-2]
        self.n_tokens += n_new
        tdn = str(self.tail_dtype).removeprefix("torch.")
        self._checked("K (from the model)", off, lambda t: t, k)
        self._checked("V (from the model)", off, lambda t: t, v)
        if self.compute != "exact":
            kcompute.append_kv(self, k, v)
            self.n_body = self.n_tokens
            return self.keys, self.values  # unused: kvarn.llamacpp_cpu.compute.attention reads k_op / v_op
        # Forget what no query of this ubatch or later reads (kept from n_body on: KVarN's
        # staging rows and the body rows its next group is written to).
        self.kv_offset = lo = self.first_readable(off)
        r = self.rows
        for buf in r.values():
            buf.forget_before(min(lo, self.n_body))
        if self.keep_exact:
            r["ek"].append(self._checked(f"K (exact, {tdn})", off, self._exact_copy("k"), k))
            r["ev"].append(self._checked(f"V (exact, {tdn})", off, self._exact_copy("v"), v))
        if self.group == 1:
            # Standard and float types: every token is written to the body at once, from fp32.
            r["k"].append(self._checked(f"K (body, {self.k_fmt.name})", off, self._k_roundtrip, k.contiguous()))
            r["v"].append(self._checked(f"V (body, {self.v_fmt.name})", off, self.v_fmt.roundtrip, v.contiguous()))
            self.n_body = self.n_tokens
        else:
            # KVarN: quantize every group whose last token has now arrived, from the staging
            # copy; the rows of the incomplete group stay zero until then.
            r["k"].extend(k, n_new)
            r["v"].extend(v, n_new)
            done = (self.n_tokens // self.group) * self.group
            if done > self.n_body:
                nb = self.n_body
                r["k"].write(nb, self._checked(f"K (body, {self.k_fmt.name})", nb, self.k_fmt.roundtrip,
                                               r["ek"].view(nb, done).float().contiguous()))
                r["v"].write(nb, self._checked(f"V (body, {self.v_fmt.name})", nb, self.v_fmt.roundtrip,
                                               r["ev"].view(nb, done).float().contiguous()))
                self.n_body = done
        self.keys, self.values = r["k"].view(lo, self.n_tokens), r["v"].view(lo, self.n_tokens)
        if self.keep_exact:
            self.exact_keys, self.exact_values = r["ek"].view(lo, self.n_tokens), r["ev"].view(lo, self.n_tokens)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # (kv_length, kv_offset) before `update`, as transformers' DynamicSlidingWindowLayer
        # gives them: the mask covers exactly the rows `update` will return.
        lo = self.first_readable(self.n_tokens)
        return self.n_tokens + query_length - lo, lo

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_max_length(self) -> int:
        return -1

    def stored_rows(self) -> int:
        """Rows allocated per copy (the largest buffer), for the memory tests and benches."""
        return max((b.capacity for b in self.rows.values()), default=0)

    def reset(self) -> None:
        self.keys = self.values = self.exact_keys = self.exact_values = None
        self.k_op = self.v_op = None
        self.rows = {}
        self.n_tokens = self.n_body = self.q_offset = self.kv_offset = 0
        self.is_initialized = False


class KVarnCache(Cache):
    """A transformers Cache implementing DESIGN §2 for one model and one cell (`kvarn.vocab.cell.CellSpec`).

        cache = KVarnCache(model.config, CellSpec("q4_0", "q4_0", tail=128))
        model(ids, cache=cache, kvarn_cache=cache)   # with attn_implementation "kvarn"

    `attention`: "ref" (kvarn.kvcache.attention's blocked sdpa) or "flex" (kvarn.kvcache.flex, one
    flex_attention call per layer call): the same numbers at fp32 noise.

    `compute="llamacpp-cpu"` emulates llama.cpp's CPU flash-attention arithmetic instead of
    exact fp32 attention (kvarn.llamacpp_cpu.compute; upstream llama.cpp types, tail 0), in llama.cpp's
    channel order of Q and K (`kvarn.llamacpp_cpu.channel_order.gguf_qk_permuted` of the model_type). With
    a KVarN pair or a tail it takes BeeLlama's scalar CPU route (`scalar_route`): exact layers,
    a standard K's body rounded in that channel order.

    `layers[i]` is a `KVarnLayer` on attention layers and transformers' own state layer
    (e.g. `LinearAttentionLayer`) elsewhere; `policies[i]` is the layer's `LayerPolicy`,
    or None on a layer without a KV cache; `layer_types[i]` its (K type, V type). `k_fmt` and
    `v_fmt` are the cell's pair (an allocation's main types), each layer's own are its `KVarnLayer`'s.
    """

    def __init__(self, config, cell: CellSpec, attention: str = "ref"):
        if not isinstance(cell, CellSpec):
            raise TypeError(f"KVarnCache takes a kvarn.vocab.cell.CellSpec (validated once there), got {cell!r}")
        self.cell = cell
        self.compute = cell.compute
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention path {attention!r} not accepted; use one of {', '.join(ATTENTION_PATHS)} "
                             "(kvarn.kvcache.attention.resolve_attention turns 'auto' into one)")
        self.attention = attention  # how `kvarn.kvcache.attention` computes the exact compute path
        # `exact` keeps transformers' order (DESIGN §6b's format damage); llamacpp-cpu llama.cpp's
        self.qk_gguf_order = cell.compute == LLAMACPP_CPU and gguf_qk_permuted(text_config(config).model_type)
        # llamacpp-cpu with a KVarN pair or a tail: BeeLlama's scalar route, whose arithmetic is the
        # exact path's (kvarn.vocab.options.scalar_route), so its layers store and attend as exact ones
        self.scalar_route = scalar_route(cell.compute, cell.k, cell.v, cell.tail)
        # bf16-attn / tf32-attn: the exact path's layers, its attention's operands rounded
        # (kvarn.vocab.options.ATTENTION_ROUNDING; kvarn.kvcache.attention applies it)
        self.attn_rounding: str | None = ATTENTION_ROUNDING.get(cell.compute)
        layer_compute = EXACT if self.scalar_route or cell.compute in ATTENTION_ROUNDING else self.compute
        fmts = {}

        def fmt(name: str, role: str):
            if (name, role) not in fmts:
                fmts[name, role] = make_format(name, role, cell.rot, cell.iters)
            return fmts[name, role]

        self.k_fmt, self.v_fmt = fmt(cell.k, "k"), fmt(cell.v, "v")
        if self.scalar_route and self.k_fmt.group > 1 and self.qk_gguf_order:
            raise ValueError(f"compute {LLAMACPP_CPU}: {cell.k}/{cell.v} on a {text_config(config).model_type} model, "
                             "whose GGUF permutes Q/K channels: BeeLlama's KVarN tiles in that order are not emulated")
        self.tail_dtype_name = cell.tail_dtype or default_tail_dtype(self.k_fmt, self.v_fmt)
        td = FLOAT_DTYPES[self.tail_dtype_name]
        self.geometry: Geometry = geometry_from_config(config)
        self.windows = list(self.geometry.windows)
        self.layer_types = layer_types(cell, self.geometry)  # (K, V) per decoder layer
        layer_fmts = {i: (fmt(self.layer_types[i][0], "k"), fmt(self.layer_types[i][1], "v"))
                      for i in self.geometry.kv_layers}
        for i, pair in layer_fmts.items():
            d = self.geometry.layers[i].head_dim
            for f in pair:
                try:
                    f.check_head_dim(d)
                except ValueError as e:
                    raise ValueError(f"layer {i} ({self.geometry.layers[i].kind}) has head dim {d}: {e}") from e
                if self.scalar_route and f.group > 1 and d not in BEELLAMA_KVARN_HEAD_DIMS:
                    raise ValueError(f"compute {LLAMACPP_CPU}: layer {i} has head dim {d}; BeeLlama's KVarN takes "
                                     f"head dims {', '.join(map(str, BEELLAMA_KVARN_HEAD_DIMS))} only")
        self.policies: list[LayerPolicy | None] = [
            layer_policy(*layer_fmts[i], cell.tail, g.window, cell.sink) if g.has_kv else None
            for i, g in enumerate(self.geometry.layers)
        ]
        state = _state_layers(config, self.geometry)
        layers = [KVarnLayer(*layer_fmts[i], p, td, i, layer_compute, self.qk_gguf_order,
                             self._exact_rotation(self.geometry.layers[i].head_dim, *layer_fmts[i]), self.attn_rounding)
                  if p is not None else state[i]
                  for i, p in enumerate(self.policies)]
        super().__init__(layers=layers)

    def _exact_rotation(self, head_dim: int, k_fmt, v_fmt) -> dict | None:
        """On BeeLlama's scalar route, the rotation blocks llama.cpp applies to a quantized K and V
        before storing them (`attn_rot_k` / `attn_rot_v`: block types with rot), which its exact
        copy keeps in the rotated frame; None elsewhere (the exact copy is the tail dtype's)."""
        if not self.scalar_route:
            return None
        return {r: f.rotation_block(head_dim) if f.family == "block" and f.rot else None
                for r, f in (("k", k_fmt), ("v", v_fmt))}

    @property
    def kv_policies(self) -> list[LayerPolicy]:
        """The policies of the attention layers, in layer order (what summaries report)."""
        return [p for p in self.policies if p is not None]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def reserve(self, n_ctx: int) -> None:
        """Size every attention layer's buffers for a chunk of n_ctx tokens (before its first ubatch)."""
        for layer in self.layers:
            if isinstance(layer, KVarnLayer):
                layer.n_ctx = n_ctx


def probe_cache(config, layer: int, role: str, type_name: str, tail: int, attention: str = "ref") -> KVarnCache:
    """The per-layer sensitivity's cache (kvarn.perlayer.sensitivity): the baseline's (BF16 K and V,
    tail 0) on every layer but `layer`, whose `role` ("k" or "v") is stored as `type_name` under the
    policy of that type's uniform cell at `tail` (its sink, effective tail and exact-copy dtype) and
    whose other role keeps a BF16 body. So the KLD against the baseline is what quantizing that one
    layer's K (or V) alone adds; every other layer is the baseline's, bit for bit."""
    if role not in ("k", "v"):
        raise ValueError(f"role {role!r}: use 'k' or 'v'")
    cache = KVarnCache(config, CellSpec("bf16", "bf16", 0), attention=attention)
    geom = cache.geometry
    if not 0 <= layer < geom.n_layers or not geom.layers[layer].has_kv:
        kv = ", ".join(map(str, geom.kv_layers))
        raise ValueError(f"layer {layer} is not a layer with a KV cache of this model; its KV layers are {kv}")
    cell = CellSpec(type_name, type_name, tail)  # validates the type and tail as a cell would
    fmt = make_format(type_name, role, cell.rot, cell.iters)
    other = make_format("bf16", "v" if role == "k" else "k", cell.rot, cell.iters)
    k_fmt, v_fmt = (fmt, other) if role == "k" else (other, fmt)
    policy = layer_policy(fmt, fmt, tail, geom.layers[layer].window, cell.sink)
    td = FLOAT_DTYPES[cell.tail_dtype or default_tail_dtype(fmt, fmt)]
    cache.layers[layer] = KVarnLayer(k_fmt, v_fmt, policy, td, layer, EXACT)
    cache.policies[layer] = policy
    cache.layer_types[layer] = (k_fmt.name, v_fmt.name)
    return cache


def _state_layers(config, geometry: Geometry) -> dict[int, object]:
    """Transformers' own cache layers for the layers that keep a state instead of K/V,
    built as `DynamicCache` builds them (same class, same per-layer kwargs)."""
    idx = [i for i, g in enumerate(geometry.layers) if not g.has_kv]
    if not idx:
        return {}
    types, kwargs = get_layer_types_and_kwargs(text_config(config))
    out = {}
    for i in idx:
        kind = geometry.layers[i].kind
        if types[i] != kind or kind not in DYNAMIC_LAYER_TYPE_MAPPING:
            raise ValueError(
                f"layer {i}: kvarn reads layer type {kind!r} but transformers' cache would build {types[i]!r}"
            )
        out[i] = DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs[i])
    return out
