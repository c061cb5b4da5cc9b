"""GGUF round trip through llama.cpp's own converter: tiny random qwen3_5 and gemma4 models.

    .venv/bin/python -m bench.oracles.llamacpp.gguf_roundtrip --llama-cpp DIR [--out bench/oracles/llamacpp/results/gguf_roundtrip.md]

DIR is llama.cpp's source tree with ``convert_hf_to_gguf.py`` and ``gguf-py`` (pinned: the
copy vendored in the llama-cpp-python 0.3.36 sdist on PyPI, ``vendor/llama.cpp``). It is
not part of this repository and this script never runs in CI.

For each architecture: a tiny random image-text checkpoint with the real classes
(Qwen3_5ForConditionalGeneration: 3 Gated DeltaNet + 1 gated attention layer, 4 V / 2 QK
linear heads so the V-head reordering is exercised; Gemma4ForConditionalGeneration: 3
sliding + 1 full layer with its own head dim and KV heads and K = V), norms and A_log
perturbed so a missing shift or sign shows; saved with a real tokenizer (SmolLM2's BPE for
qwen3_5, Gemma 3's for gemma4); converted by llama.cpp at --outtype f32 and q8_0; loaded by
`kvarn.weights.gguf_weights.load`; logits compared with the HF model's own forward (f32) on 64
random tokens. For q8_0 the reference is the HF model with every tensor the converter
quantizes replaced by gguf's own Q8_0 quantize -> dequantize, so the figure is the loader's
error, not the quantization's.

The converter's tokenizer pre-type check (a hash of known tokenizers) is bypassed: this
measures the tensor mapping; the tokenizers are compared separately (ids on a probe text).
Writes a Markdown report atomically and prints it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import REPO as ROOT

from kvarn.files.atomic import write_text

PROBE = " = Valkyria Chronicles III = \n Senjō no Valkyria 3 : <unk> Chronicles ( Japanese : 戦場のヴァルキュリア3 ) , 1 @,@ 000 \n"

# Runs the converter with its tokenizer pre-type check answered (see the docstring).
RUNNER = """
import runpy, sys
root = sys.argv.pop(1)  # its converter and gguf-py come first on PYTHONPATH (convert below)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tiny(arch: str, out: Path):
    from transformers import (AutoTokenizer, Gemma4Config, Gemma4ForConditionalGeneration, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration)

    torch.manual_seed(0)
    if arch == "qwen35":
        tok = AutoTokenizer.from_pretrained(ROOT / "resources/models/smollm2-135m/hf")
        text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=text, tie_word_embeddings=False,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)))
    else:
        tok = AutoTokenizer.from_pretrained(ROOT / "resources/models/gemma3-270m/hf")
        text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"], hidden_size_per_layer_input=0,
                    vocab_size_per_layer_input=len(tok), final_logit_softcapping=30.0)
        model = Gemma4ForConditionalGeneration(Gemma4Config(
            text_config=text, audio_config=None,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=16)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("norm", "A_log", "dt_bias", "layer_scalar")):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def convert(llama_cpp: Path, src: Path, out: Path, outtype: str) -> None:
    cmd = [sys.executable, "-c", RUNNER, str(llama_cpp), str(src), "--outtype", outtype, "--outfile", str(out)]
    if "qwen" in src.name:
        cmd.append("--no-mtp")  # the tiny model has no multi-token-prediction head
    path = os.pathsep.join([str(llama_cpp), str(llama_cpp / "gguf-py")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {src.name} --outtype {outtype} failed:\n{r.stderr[-3000:]}")


def _qdq(w: torch.Tensor) -> torch.Tensor:
    """gguf's own Q8_0 quantize -> dequantize, blocks of 32 along the last (input) dim."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    a = w.detach().float().numpy()
    return torch.from_numpy(np.asarray(dequantize(quantize(a, T.Q8_0), T.Q8_0)).reshape(a.shape).copy())


def _tiled(w: torch.Tensor, n_k: int, per_k: int, hd: int, inverse: bool = False) -> torch.Tensor:
    """llama.cpp's V-head order on the input dim of out_proj: grouped [n_k, per_k, hd] <-> tiled."""
    shape = (w.shape[0], per_k, n_k, hd) if inverse else (w.shape[0], n_k, per_k, hd)
    return w.reshape(shape).transpose(1, 2).reshape(w.shape)


def q8_reference(model, gguf_path: Path, arch: str):
    """`model` with each text tensor the GGUF stores as Q8_0 put through gguf's Q8_0
    quantize -> dequantize in the GGUF's layout (the converter quantizes the same values)."""
    import copy

    from gguf import GGMLQuantizationType, GGUFReader
    from transformers import AutoModelForCausalLM

    from kvarn.weights.gguf_weights import hf_to_gguf_names

    q8 = {t.name for t in GGUFReader(str(gguf_path)).tensors if t.tensor_type == GGMLQuantizationType.Q8_0}
    cfg = model.config.get_text_config()
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(cfg)
    names = hf_to_gguf_names(causal, arch, strict=False)
    ref = copy.deepcopy(model)
    own = ref.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, gname in names.items():
            if gname not in q8:
                continue
            p = own[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key]
            if gname.endswith("ssm_out.weight") and cfg.linear_num_value_heads != cfg.linear_num_key_heads:
                n_k, hd = cfg.linear_num_key_heads, cfg.linear_value_head_dim
                per_k = cfg.linear_num_value_heads // n_k
                p.copy_(_tiled(_qdq(_tiled(p, n_k, per_k, hd)), n_k, per_k, hd, inverse=True))
            else:
                p.copy_(_qdq(p))
    return ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gguf_roundtrip.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvarn.weights import gguf_weights

    rows = []
    ids = torch.randint(0, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for arch in ("qwen35", "gemma4"):
            model, hf_tok = tiny(arch, tmp / arch)
            for outtype in ("f32", "q8_0"):
                gguf = tmp / f"{arch}-{outtype}.gguf"
                convert(args.llama_cpp, tmp / arch, gguf, outtype)
                loaded, tok = gguf_weights.load(gguf, "cpu", torch.float32)
                ref = model if outtype == "f32" else q8_reference(model, gguf, arch)
                with torch.no_grad():
                    want = ref(input_ids=ids).logits
                    got = loaded.eval()(input_ids=ids).logits
                    plain = model(input_ids=ids).logits
                d = (got - want).abs().max().item()
                effect = (got - plain).abs().max().item()  # what a wrong reference would show
                same_ids = tok(PROBE)["input_ids"] == hf_tok(PROBE)["input_ids"]
                rows.append(f"| {arch} | {type(loaded).__name__} | {outtype} | {d:.3g} | {effect:.3g} | "
                            f"{want.abs().max().item():.3g} | {'yes' if same_ids else 'NO'} |")
                print(rows[-1], flush=True)
    version = (args.llama_cpp / "gguf-py" / "pyproject.toml").read_text().split('version = "')[1].split('"')[0]
    report = "\n".join([
        "# GGUF round trip through llama.cpp's converter",
        "",
        f"`{' '.join(['python', 'bench/oracles/llamacpp/gguf_roundtrip.py', '--llama-cpp', str(args.llama_cpp)])}`",
        "",
        f"Converter: `convert_hf_to_gguf.py` of `{args.llama_cpp}` (its gguf-py {version}); loader: "
        "`kvarn.weights.gguf_weights.load` (qwen35 through transformers' GGUF loader, gemma4 through kvarn's "
        "own config + the gguf package's tensor-name table). Tiny random image-text checkpoints "
        "(see the script), 64 random tokens, fp32 on CPU. Reference: the HF model's own forward "
        "(q8_0: with gguf's Q8_0 quantize -> dequantize applied to the tensors the GGUF quantizes).",
        "",
        "| arch | loaded as | GGUF type | max abs logit difference vs reference | vs the unquantized HF model "
        "| max abs logit | tokenizer ids equal on a probe |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    write_text(args.out, report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
