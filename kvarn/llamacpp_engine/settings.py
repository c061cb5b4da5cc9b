"""A model's engine in the matrix, torch-free (kvarn.plan.matrix reads it when planning).

`engine: torch` (the default) runs the cell through transformers with the cache model emulated
in PyTorch (kvarn.run.torch_engine); `engine: llama.cpp` runs it through a llama.cpp build, the
program's own logits (kvarn.llamacpp_engine.runner). The llama.cpp engine takes a block of settings:

    engine: {name: llama.cpp, build: upstream, threads: 2, batch: 2048, flash_attn: "on",
             gpu_layers: 0, args: [--no-mmap], env: {GGML_KVARN_WINDOW_CHUNK: "4"}}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ENGINE = "llama.cpp"
ENGINES = ("torch", ENGINE)
FLASH_ATTN = ("on", "off", "auto")


@dataclass(frozen=True)
class Settings:
    """A model's `engine` block in the matrix (config/README.md): how the program is run."""

    build: str | None = None  # a build folder, "upstream", or None: $KVARN_LLAMACPP_BUILD
    threads: int | None = None  # -t; None: the job's threads
    batch: int = 2048  # -b (capped at n_ctx)
    flash_attn: str = "on"  # -fa
    gpu_layers: int = 0  # -ngl
    args: tuple[str, ...] = ()  # more llama-perplexity options, e.g. [--no-mmap, --mlock]
    env: dict = field(default_factory=dict)  # environment for the program, e.g. {GGML_KVARN_WINDOW_CHUNK: "4"}
    decode_depths: tuple[float, ...] = ()  # decode speed through llama-bench at these fractions of n_ctx
    decode_tokens: int = 32  # tokens generated per decode-speed test

    @classmethod
    def from_config(cls, raw: dict | None, where: str = "engine") -> Settings:
        raw = dict(raw or {})
        raw.pop("name", None)
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; accepted: name, "
                             f"{', '.join(cls.__dataclass_fields__)}")
        s = cls(**{**raw, "args": tuple(str(a) for a in raw.get("args", ())),
                   "env": {str(k): str(v) for k, v in (raw.get("env") or {}).items()},
                   "decode_depths": tuple(raw.get("decode_depths", ()))})
        for d in s.decode_depths:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
                raise ValueError(f"{where}.decode_depths: {d!r}; give fractions of n_ctx in [0, 1], e.g. [0, 0.5, 1]")
        if s.flash_attn not in FLASH_ATTN:
            raise ValueError(f"{where}.flash_attn: {s.flash_attn!r}; accepted: {', '.join(FLASH_ATTN)}")
        for name, lo in (("batch", 1), ("gpu_layers", 0), ("decode_tokens", 1)):
            v = getattr(s, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{where}.{name}: {v!r} must be an integer >= {lo}")
        if s.threads is not None and (isinstance(s.threads, bool) or not isinstance(s.threads, int) or s.threads < 1):
            raise ValueError(f"{where}.threads: {s.threads!r} must be an integer >= 1 (or absent: the job's threads)")
        return s

    def as_param(self) -> dict:
        return {**asdict(self), "args": list(self.args), "decode_depths": list(self.decode_depths)}


def engine_of(raw) -> tuple[str, dict | None]:
    """(engine name, its settings block) of a model's `engine` value: absent/"torch", "llama.cpp",
    or a mapping with `name`."""
    if raw is None:
        return "torch", None
    if isinstance(raw, str):
        name, block = raw, None
    elif isinstance(raw, dict):
        name, block = raw.get("name", ENGINE), raw
    else:
        raise ValueError(f"engine: {raw!r}; give 'torch', 'llama.cpp' or a mapping with name: llama.cpp")
    if name not in ENGINES:
        raise ValueError(f"engine: {name!r} is not an engine; accepted: {', '.join(ENGINES)}")
    return name, block
