"""The KV cache model of SPEC §2 as a transformers `Cache`: per layer an exact and a body copy.

Each layer keeps, for every token it has seen (all positions, also on sliding-window
layers, whose window is applied by the mask):

* the **exact** copy: K (post-RoPE, as `Cache.update` receives it) and V rounded to the
  tail dtype (bf16 for standard types, f16 for KVarN), held as fp32 tensors;
* the **body** copy: K and V through `fmt.roundtrip`, the value attention reads back
  from the quantized cache. Standard types write the body per token, at once (so with
  tail 0 a query reads even its own key from the body, as llama.cpp does). KVarN writes
  whole groups of `fmt.group` = 128 tokens aligned to chunk position 0, quantized once
  their last token has arrived, from the tail-dtype staging copy (BeeLlama stages in
  F16); rows of an incomplete group stay zero and are never read (the tail, >= 128,
  always covers them; `kvarn.attention` asserts it).

Which copy a (query, key) pair reads is decided in `kvarn.attention` from
`exact_selection` below and the layer's `kvarn.policy.LayerPolicy`.

Layers are built per layer from `kvarn.geometry.geometry_from_config` (the one source of
layer types and per-layer KV heads / head dim / window): attention layers get a
`KVarnLayer` (its shape comes from the K/V the layer writes, so Gemma 4's 512-wide full
layers and 256-wide sliding layers each get their own), and layers with their own state
(Qwen 3.5/3.6 Gated DeltaNet `linear_attention`) get transformers' own cache layer for
that type, so their conv and recurrent state is exactly what the model's `DynamicCache`
would keep, in the baseline and in every cell.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

from kvarn.formats import get_format
from kvarn.formats.base import ValueRangeError, check_finite
from kvarn.geometry import Geometry, geometry_from_config, text_config
from kvarn.policy import LayerPolicy, default_tail_dtype, layer_policy

TAIL_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window W, or None for full attention.

    Read as the transformers modeling code does (`layer_types` when present, else one
    `sliding_window` for all layers when enabled): `kvarn.geometry.geometry_from_config`.
    """
    return list(geometry_from_config(config).windows)


def exact_selection(q_pos: torch.Tensor, kv_len: int, policy: LayerPolicy) -> torch.Tensor:
    """bool [n_queries, kv_len]: True where the query at q_pos reads key j from the exact copy.

    SPEC §2: exact if j < sink or p - j < tail. Causality and the sliding window are not
    applied here; the attention mask does that (the selection only picks the copy).
    """
    j = torch.arange(kv_len, device=q_pos.device)
    dist = q_pos[:, None] - j[None, :]
    return (j[None, :] < policy.sink) | (dist < policy.tail)


def make_format(name: str, role: str, rot: bool = True, iters: int = 16):
    """get_format, passing `iters` only to the formats that take it (KVarN)."""
    fmt = get_format(name, role=role, rot=rot)
    if fmt.family == "kvarn":
        fmt = get_format(name, role=role, rot=rot, iters=iters)
    return fmt


class KVarnLayer(CacheLayerMixin):
    """One decoder layer's cache: exact and body copies of K and V, fp32 [batch, kv_heads, n, head_dim]."""

    is_compileable = False
    is_croppable = False

    def __init__(self, k_fmt, v_fmt, policy: LayerPolicy, tail_dtype: torch.dtype, layer_idx: int = 0,
                 compute: str = "exact"):
        super().__init__()
        self.layer_idx = layer_idx
        self.k_fmt, self.v_fmt, self.policy, self.tail_dtype = k_fmt, v_fmt, policy, tail_dtype
        # "llamacpp-cpu": the layer keeps what ggml's kernel reads instead (kvarn.compute)
        self.compute = compute
        self.k_op = self.v_op = None
        self.is_sliding = policy.window is not None
        if k_fmt.group != v_fmt.group:
            raise ValueError(f"K type {k_fmt.name} and V type {v_fmt.name} have different group sizes")
        self.group = k_fmt.group
        # The exact copy is needed when some query reads it, or as KVarN's staging group.
        self.keep_exact = policy.sink > 0 or policy.tail > 0 or self.group > 1
        self.exact_keys = self.exact_values = None
        self.n_tokens = 0
        self.n_body = 0  # tokens whose body copy has been written
        self.q_offset = 0  # position of the first query of the ubatch being processed

    def lazy_initialization(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d), dtype=torch.float32)
        self.keys = self.values = empty
        self.exact_keys = self.exact_values = empty
        self.device = key_states.device
        self.is_initialized = True

    def _checked(self, what: str, offset: int, fn, *args) -> torch.Tensor:
        """fn(*args), a finite [b, H, n, D] tensor; a value that cannot be stored, or a
        non-finite result, is a ValueError naming layer, K/V, head and absolute token."""
        try:
            return check_finite(what, fn(*args), "the value")
        except ValueRangeError as e:
            raise ValueError(f"{e.where(self.layer_idx, offset, what)}: {e.detail} [{e.name}]") from None

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.tail_dtype).float()

    def update(self, key_states, value_states, *args, **kwargs):
        """Store a ubatch's post-RoPE K and V; return the body copies (what the body half reads)."""
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
            from kvarn import compute

            compute.append_kv(self, k, v)
            self.n_body = self.n_tokens
            return self.keys, self.values  # unused: kvarn.compute.attention reads k_op / v_op
        if self.keep_exact:
            ek = self._checked(f"K (exact, {tdn})", off, self._exact, k)
            ev = self._checked(f"V (exact, {tdn})", off, self._exact, v)
            self.exact_keys = torch.cat([self.exact_keys, ek], dim=-2)
            self.exact_values = torch.cat([self.exact_values, ev], dim=-2)
        if self.group == 1:
            # Standard and float types: every token is written to the body at once, from fp32.
            bk = self._checked(f"K (body, {self.k_fmt.name})", off, self.k_fmt.roundtrip, k.contiguous())
            bv = self._checked(f"V (body, {self.v_fmt.name})", off, self.v_fmt.roundtrip, v.contiguous())
            self.keys = torch.cat([self.keys, bk], dim=-2)
            self.values = torch.cat([self.values, bv], dim=-2)
            self.n_body = self.n_tokens
        else:
            # KVarN: quantize every group whose last token has now arrived, from the staging copy.
            done = (self.n_tokens // self.group) * self.group
            new_k, new_v = [self.keys[..., : self.n_body, :]], [self.values[..., : self.n_body, :]]
            if done > self.n_body:
                nb = self.n_body
                new_k.append(self._checked(f"K (body, {self.k_fmt.name})", nb, self.k_fmt.roundtrip,
                                           self.exact_keys[..., nb:done, :].contiguous()))
                new_v.append(self._checked(f"V (body, {self.v_fmt.name})", nb, self.v_fmt.roundtrip,
                                           self.exact_values[..., nb:done, :].contiguous()))
                self.n_body = done
            pad = self.n_tokens - self.n_body
            if pad:
                z = k.new_zeros((*k.shape[:-2], pad, k.shape[-1]))
                new_k.append(z)
                new_v.append(z)
            self.keys = torch.cat(new_k, dim=-2)
            self.values = torch.cat(new_v, dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Full-length on sliding layers too: the sliding mask over all positions reproduces
        # the single pass exactly.
        return self.n_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.exact_keys = self.exact_values = None
        self.k_op = self.v_op = None
        self.n_tokens = self.n_body = self.q_offset = 0
        self.is_initialized = False


class KVarnCache(Cache):
    """A transformers Cache implementing SPEC §2 for one model and one (K type, V type, tail) cell.

        cache = KVarnCache(model.config, "q4_0", "q4_0", tail=128)
        model(ids, cache=cache, kvarn_cache=cache)   # with attn_implementation "kvarn"

    `compute="llamacpp-cpu"` emulates llama.cpp's CPU flash-attention arithmetic instead of
    exact fp32 attention (kvarn.compute; upstream llama.cpp types, tail 0).

    `layers[i]` is a `KVarnLayer` on attention layers and transformers' own state layer
    (e.g. `LinearAttentionLayer`) elsewhere; `policies[i]` is the layer's `LayerPolicy`,
    or None on a layer without a KV cache.
    """

    def __init__(self, config, k_type: str, v_type: str, tail: int = 0, tail_dtype: str | None = None,
                 rot: bool = True, iters: int = 16, compute: str = "exact", sink: int | None = None):
        from kvarn.compute import check_compute

        self.compute = check_compute(compute, k_type, v_type, tail)
        self.k_fmt = make_format(k_type, "k", rot, iters)
        self.v_fmt = make_format(v_type, "v", rot, iters)
        self.tail_dtype_name = tail_dtype or default_tail_dtype(self.k_fmt, self.v_fmt)
        if self.tail_dtype_name not in TAIL_DTYPES:
            raise ValueError(f"tail dtype {self.tail_dtype_name!r} not accepted; use one of {', '.join(TAIL_DTYPES)}")
        td = TAIL_DTYPES[self.tail_dtype_name]
        self.geometry: Geometry = geometry_from_config(config)
        self.windows = list(self.geometry.windows)
        for i in self.geometry.kv_layers:
            d = self.geometry.layers[i].head_dim
            for fmt in (self.k_fmt, self.v_fmt):
                try:
                    fmt.check_head_dim(d)
                except ValueError as e:
                    raise ValueError(f"layer {i} ({self.geometry.layers[i].kind}) has head dim {d}: {e}") from e
        self.policies: list[LayerPolicy | None] = [
            layer_policy(self.k_fmt, self.v_fmt, tail, g.window, sink) if g.has_kv else None for g in self.geometry.layers
        ]
        state = _state_layers(config, self.geometry)
        layers = [KVarnLayer(self.k_fmt, self.v_fmt, p, td, i, self.compute) if p is not None else state[i]
                  for i, p in enumerate(self.policies)]
        super().__init__(layers=layers)

    @property
    def kv_policies(self) -> list[LayerPolicy]:
        """The policies of the attention layers, in layer order (what summaries report)."""
        return [p for p in self.policies if p is not None]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)


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
