"""Per-layer cache geometry of a model, read once from its config (DESIGN §2). Torch-free.

Owns: the set of decoder layer types kvarn supports (`LAYER_TYPES`, the one place that
says which), `LayerGeometry` (one decoder layer: its type, KV heads, head dim, sliding
window, K/V sharing) and `Geometry` (all layers), and `geometry_from_config`, which reads
them from a transformers config object or a plain ``config.json`` dict — so a model's
geometry is known, and an unsupported layer type refused, before any weights are fetched.

The cache (`kvarn.kvcache.cache`), the memory accounting (`kvarn.budget.memory`), the preflight and the
report all read geometry from here; nothing else parses a config for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

# Decoder layer types (transformers' `layer_types` names) and what kvarn does with them:
#   "kv"    - an attention layer: its K/V go through the kvarn cache model (DESIGN §2);
#   "state" - a layer with its own recurrent/conv state (Gated DeltaNet): transformers'
#             own cache layer keeps it, untouched, in the baseline and in every cell.
LAYER_TYPES: dict[str, str] = {
    "full_attention": "kv",
    "sliding_attention": "kv",
    "linear_attention": "state",
}


def _positive_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class LayerGeometry:
    """One decoder layer. KV layers have n_kv_heads, head_dim >= 1; state layers have 0, 0."""

    kind: str  # a key of LAYER_TYPES
    n_kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None  # sliding window W on a sliding_attention layer, else None
    k_eq_v: bool = False  # the model feeds its K projection as V too (Gemma 4 attention_k_eq_v)

    def __post_init__(self):
        if self.kind not in LAYER_TYPES:
            raise ValueError(
                f"layer type {self.kind!r} is not supported by the kvarn cache model; "
                f"supported: {', '.join(LAYER_TYPES)}"
            )
        if self.has_kv:
            for name in ("n_kv_heads", "head_dim"):
                v = getattr(self, name)
                if not _positive_int(v):
                    raise ValueError(f"{self.kind} layer: {name} must be a positive integer, got {v!r}")
        if (self.kind == "sliding_attention") != (self.window is not None):
            raise ValueError(f"{self.kind} layer with window {self.window!r}: only sliding_attention layers have one")
        if self.window is not None and not _positive_int(self.window):
            raise ValueError(f"sliding window must be a positive integer, got {self.window!r}")

    @property
    def has_kv(self) -> bool:
        return LAYER_TYPES[self.kind] == "kv"

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class Geometry:
    """Every decoder layer of a model, in order."""

    layers: tuple[LayerGeometry, ...]

    def __post_init__(self):
        if not self.layers or not all(isinstance(layer, LayerGeometry) for layer in self.layers):
            raise ValueError("Geometry.layers must be a non-empty tuple of LayerGeometry")
        if not any(layer.has_kv for layer in self.layers):
            raise ValueError("the model has no attention layer: there is no KV cache to measure")

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, head_dim: int,
                windows: tuple[int | None, ...] | None = None) -> Geometry:
        """Attention layers that share one KV-head count and head dim; `windows` per layer
        (a sliding window W, or None for full attention; default all full)."""
        if not _positive_int(n_layers):
            raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
        windows = (None,) * n_layers if windows is None else tuple(windows)
        if len(windows) != n_layers:
            raise ValueError(
                f"windows has {len(windows)} entries for {n_layers} layers; give one window (or None) per layer"
            )
        return cls(tuple(
            LayerGeometry("full_attention" if w is None else "sliding_attention", n_kv_heads, head_dim, w)
            for w in windows
        ))

    def to_list(self) -> list[list]:
        """JSON form, one [kind, n_kv_heads, head_dim, window, k_eq_v] per layer: a cell's
        summary.json records it, so its memory can be recomputed without the model."""
        return [[x.kind, x.n_kv_heads, x.head_dim, x.window, x.k_eq_v] for x in self.layers]

    @classmethod
    def from_list(cls, rows) -> Geometry:
        """Inverse of `to_list` (each layer checked as when built)."""
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) and len(r) == 5 for r in rows):
            raise ValueError("a geometry list has one [kind, n_kv_heads, head_dim, window, k_eq_v] per layer")
        return cls(tuple(LayerGeometry(*r) for r in rows))

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window W, or None (full attention, or no KV cache)."""
        return tuple(layer.window for layer in self.layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose K/V go through the cache model."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.has_kv)

    def describe(self) -> str:
        """One line per distinct layer shape, e.g. '48 linear_attention; 16 full_attention (4 x 256)'."""
        counts: dict[tuple, int] = {}
        for layer in self.layers:
            key = (layer.kind, layer.n_kv_heads, layer.head_dim, layer.window, layer.k_eq_v)
            counts[key] = counts.get(key, 0) + 1
        parts = []
        for (kind, h, d, w, keqv), n in counts.items():
            s = f"{n} {kind}"
            if LAYER_TYPES[kind] == "kv":
                s += f" ({h} KV heads x {d}" + (f", W {w}" if w else "") + (", K=V" if keqv else "") + ")"
            parts.append(s)
        return "; ".join(parts)


# ----------------------------------------------------------------------------- reading configs


def _get(c: Any, name: str, default=None):
    if isinstance(c, Mapping):
        return c.get(name, default)
    try:
        return getattr(c, name, default)
    except Exception:  # transformers raises on ambiguous global per-layer attributes (Gemma 4 head_dim)
        return default


def text_config(config: Any) -> Any:
    """The decoder (text) part of a config: `get_text_config()` for transformers objects,
    the ``text_config`` sub-dict of an image-text ``config.json``, else the config itself."""
    if not isinstance(config, Mapping):
        return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return config.get("text_config") or config


def layer_types_of(config: Any) -> list[str]:
    """The per-layer type names as the modeling code reads them (no validation)."""
    c = text_config(config)
    n_layers = int(_get(c, "num_hidden_layers"))
    types = _get(c, "layer_types")
    if types:
        types = list(types)
        if len(types) != n_layers:
            raise ValueError(f"config has {len(types)} layer_types for {n_layers} layers")
        return types
    window = _get(c, "sliding_window")
    if window and _get(c, "use_sliding_window", True):
        return ["sliding_attention"] * n_layers
    return ["full_attention"] * n_layers


def check_layer_types(config: Any) -> None:
    """Refuse a config with a layer type kvarn does not support, naming it (before any download)."""
    types = layer_types_of(config)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        where = {t: [i for i, x in enumerate(types) if x == t] for t in unknown}
        raise ValueError(
            f"layer types {unknown} (layers {where}) are not supported by the kvarn cache model; "
            f"supported: {', '.join(LAYER_TYPES)}"
        )
    kv_sharing = _get(text_config(config), "num_kv_shared_layers", 0) or 0
    if kv_sharing:
        raise ValueError(
            f"num_kv_shared_layers = {kv_sharing}: layers that reuse another layer's KV cache are not "
            "supported by the kvarn cache model"
        )


def _per_layer(c: Any, i: int, name: str):
    """A per-layer attribute: transformers' `per_layer_config[i]` when the config has one
    (Gemma 4 overrides head dim and KV heads on full layers), else the global value."""
    plc = _get(c, "per_layer_config")
    if plc is not None:
        v = getattr(plc[i], name, None)
        if v is not None:
            return v
    return _get(c, name)


def config_object(config: Any) -> Any:
    """A transformers config object from a ``config.json`` dict (its own config class
    resolves per-layer overrides such as Gemma 4's global head dim); objects pass through."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    model_type = config.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type: cannot tell which architecture it describes")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except ValueError as e:
        raise ValueError(f"model_type {model_type!r} is not known to this transformers version: {e}") from e


def geometry_from_config(config: Any) -> Geometry:
    """Per-layer geometry of a transformers config object or a ``config.json`` dict."""
    check_layer_types(config)
    config = config_object(config)
    c = text_config(config)
    types = layer_types_of(config)
    n_heads = int(_get(c, "num_attention_heads"))
    window = _get(c, "sliding_window")
    k_eq_v = bool(_get(c, "attention_k_eq_v", False))
    if "sliding_attention" in types and not window:
        raise ValueError("config declares sliding-attention layers but no sliding_window")
    layers = []
    for i, kind in enumerate(types):
        if LAYER_TYPES[kind] != "kv":
            layers.append(LayerGeometry(kind))
            continue
        vals = {name: _per_layer(c, i, name) for name in ("num_key_value_heads", "head_dim")}
        n_kv = int(vals["num_key_value_heads"] or n_heads)
        head_dim = int(vals["head_dim"] or int(_get(c, "hidden_size")) // n_heads)
        layers.append(LayerGeometry(
            kind, n_kv, head_dim,
            window=int(window) if kind == "sliding_attention" else None,
            k_eq_v=k_eq_v and kind == "full_attention",
        ))
    return Geometry(tuple(layers))
