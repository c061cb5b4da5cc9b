"""One registry maps a format name to its factory; nothing else switches on names."""

from __future__ import annotations

from typing import Callable

_FACTORIES: dict[str, Callable] = {}


def register(name: str, factory: Callable) -> None:
    if name in _FACTORIES:
        raise ValueError(f"format {name!r} registered twice")
    _FACTORIES[name] = factory


def names() -> list[str]:
    return list(_FACTORIES)


def get_format(name: str, role: str = "k", rot: bool = True, **params):
    """The format called `name` for K (role="k") or V (role="v").

    rot: llama.cpp's Hadamard pre-rotation for quantized standard types (default on, as
    llama.cpp); ignored by float types; KVarN always rotates (DESIGN §4).
    params: format-specific knobs, e.g. iters (normalization passes) for KVarN.
    """
    if not isinstance(name, str) or name not in _FACTORIES:
        raise ValueError(f"unknown KV cache type {name!r}; accepted: {', '.join(_FACTORIES)}")
    return _FACTORIES[name](role=role, rot=rot, **params)
