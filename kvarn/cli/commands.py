"""The `kvarn` subcommands that are more than one library call: advise, memory, formats, decode and
layers, each from parsed arguments to its printed text (or exit code)."""

from __future__ import annotations

from pathlib import Path

from kvarn.budget.memory import MIB, at_tail0, kv_bytes
from kvarn.budget.model_config import memory_config
from kvarn.cli.parser import UsageError, cell_spec
from kvarn.files.atomic import atomic_path
from kvarn.vocab.facts import tail_label
from kvarn.vocab.geometry import geometry_from_config


def advise(args) -> str:
    """`kvarn advise`: results/answer.md's text for a results folder and the user's tolerance."""
    import polars as pl

    from kvarn.report import advise as adv

    summary_path = Path(args.results) / "summary.parquet"
    if not summary_path.is_file():
        raise UsageError(f"--results {args.results}: no {summary_path}; run some cells first (`make run`)")
    if args.min_same_top is not None and args.min_same_top > 100:
        raise UsageError(f"--min-same-top {args.min_same_top:g}: a percentage in (0, 100]")
    given = {"max_kld": args.max_kld, "budget_mib": args.budget_mib, "budget_bits": args.budget_bits,
             "min_same_top": None if args.min_same_top is None else args.min_same_top / 100}
    tol = adv.Tolerance(**{k: v for k, v in given.items() if v is not None})
    summary = pl.read_parquet(summary_path)
    answers = adv.advise(summary, adv.token_dirs(summary, args.results), args.model, tol, args.boot, args.seed)
    return adv.answers_markdown(answers)


def memory(args) -> str:
    """`kvarn memory`: one cache's KV bytes (kvarn.budget.memory) as text, or JSON with --json."""
    import json


    config, where = memory_config(args.model, args.cache_dir)
    try:
        geom = geometry_from_config(config)
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"--model {where!r}: {e}") from None
    cell = cell_spec(args)
    b = kv_bytes(geom, args.ctx, cell, ubatch=args.ubatch, accounting=args.accounting)
    b0 = kv_bytes(geom, args.ctx, at_tail0(cell), ubatch=args.ubatch, accounting=args.accounting)

    out = {
        "config": where, "geometry": geom.describe(), "n_ctx": args.ctx, "ubatch": args.ubatch,
        "k_type": args.k, "v_type": args.v, "tail": args.tail, "tail_label": tail_label(args.k, args.v, args.tail),
        "accounting": args.accounting, **b.mib(), "delta_tail0_mib": (b.total - b0.total) / MIB,
        "body_bytes": b.body, "staging_bytes": b.staging, "overlay_bytes": b.overlay, "total_bytes": b.total,
    }
    if args.json:
        return json.dumps(out, indent=1) + "\n"
    return (
        f"{where}: {out['geometry']}\n"
        f"{args.k}/{args.v} tail {out['tail_label']}, n_ctx {args.ctx}, ubatch {args.ubatch}, "
        f"accounting {args.accounting}\n"
        f"  body     {out['body_mib']:12.2f} MiB\n"
        f"  staging  {out['staging_mib']:12.2f} MiB\n"
        f"  overlay  {out['overlay_mib']:12.2f} MiB\n"
        f"  total    {out['total_mib']:12.2f} MiB  ({out['delta_tail0_mib']:+.2f} vs tail 0)\n"
    )


def formats() -> str:
    """`kvarn formats`: every cache type with its family and bits per value at head dims 64, 128, 256."""
    from kvarn.formats import get_format, names

    rows = [f"{'type':<8} {'family':<7} {'bpv@64':>7} {'bpv@128':>8} {'bpv@256':>8}"]
    for n in names():
        fmt = get_format(n)
        bpv = []
        for d in (64, 128, 256):
            try:
                fmt.check_head_dim(d)
                bpv.append(f"{fmt.bits_per_value(d):.4g}")
            except ValueError:
                bpv.append("-")
        rows.append(f"{n:<8} {fmt.family:<7} {bpv[0]:>7} {bpv[1]:>8} {bpv[2]:>8}")
    return "\n".join(rows) + "\n"


def decode(spec, args) -> int:
    """`kvarn decode`: free-running decode of one cell against the BF16 baseline (kvarn.run.decode)."""
    cell = cell_spec(args)
    if args.tokens > args.ctx - 2:
        raise UsageError(f"--tokens {args.tokens} leaves no prompt in --ctx {args.ctx}; at most {args.ctx - 2}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from kvarn.run.decode import run_decode

    s = run_decode(spec, args.ctx, args.prompts, args.tokens, cell, Path(args.out), ubatch=args.ubatch,
                   text=args.text, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
                   attention=args.attention, block=args.block, temperature=args.temperature, seed=args.seed)
    fd = s["first_divergence"]
    print(f"{args.k}-{args.v} tail {args.tail}{s['sampling']}: {s['n_prompts']} prompts x {s['n_tokens']} tokens; first divergence "
          f"median {s['first_divergence_median']:g} ({s['n_diverged']} of {len(fd)} diverged: {fd}); "
          f"KLD along own text mean {s['decode_kld_mean']:.6f}, median {s['decode_kld_median']:.6f}; "
          f"same top {100 * s['decode_same_top']:.2f}% -> {args.out}")
    return 0


def layers(spec, args) -> int:
    """`kvarn layers`: each layer's attention error under one cell (kvarn.run.layer_error), table and figure."""
    cell = cell_spec(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from kvarn.run.load import setup
    from kvarn.run.layer_error import layer_errors
    from kvarn.report.figures import save_chart
    from kvarn.report.figures_tokens import layer_error

    loaded, chunk_ids, _ = setup(spec, args.ctx, args.chunks, args.text, args.device, args.dtype, args.cache_dir)
    table = layer_errors(loaded.model, chunk_ids, cell, ubatch=args.ubatch)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out.with_name(out.name + ".parquet")) as tmp:
        table.write_parquet(tmp)
    save_chart(layer_error(table, f"{spec.name} {args.k}-{args.v} tail {args.tail}"), out)
    print(table)
    return 0
