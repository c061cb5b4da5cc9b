"""`kvarn`'s entry point: parse the arguments, run the subcommand, and turn a bad value into exit
code 2 with a message naming it (`kvarn CMD: error: ...`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from kvarn.budget.preflight import LONG_CONTEXT_ENV, PreflightError, capacity, preflight
from kvarn.cli import commands
from kvarn.cli.parser import UsageError, build_parser, cell_spec
from kvarn.files.outlock import OutputBusy, hold_output
from kvarn.vocab.facts import job_tail, pair_effective_tail, tail_label
from kvarn.stats import paired
from kvarn.weights.sources import fetch, parse_model


def main(argv: list[str] | None = None) -> int:

    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.cmd == "formats":
            sys.stdout.write(commands.formats())
            return 0
        if args.cmd == "memory":
            sys.stdout.write(commands.memory(args))
            return 0
        if args.cmd == "advise":
            sys.stdout.write(commands.advise(args))
            return 0
        if args.cmd == "compare":
            import json


            res = paired.compare(paired.load_cell(args.a), paired.load_cell(args.b), n_boot=args.boot,
                                 seed=args.seed, block=args.block)
            sys.stdout.write(json.dumps(res, indent=1) + "\n" if args.json else paired.format_compare(res))
            return 0
        spec = parse_model(args.model)
        if args.cmd == "decode":
            return commands.decode(spec, args)
        if args.cmd == "layers":
            return commands.layers(spec, args)
        if args.cmd == "fetch":

            print(fetch(spec, cache_dir=args.cache_dir))
            return 0
        if args.chunks == 0 or args.chunks < -1:
            raise UsageError(f"--chunks must be a positive integer or -1 (all), got {args.chunks}")
        chunks = None if args.chunks == -1 else args.chunks
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        from kvarn.run import torch_engine

        if args.allow_long_context:
            os.environ[LONG_CONTEXT_ENV] = "1"  # the engine's own preflight reads it
        cell = None
        if args.cmd == "run":
            cell = cell_spec(args)  # every cell option checked before any work
            if args.tail >= args.ctx:
                raise UsageError(f"--tail {args.tail} must be smaller than --ctx {args.ctx}")
            # a tail the format rounds is the tail it runs at (KVarN: --tail 500 runs at 512)
            cell = dataclasses.replace(cell, tail=job_tail(cell.k, cell.v, cell.tail))
        if args.dry_run:

            est = preflight(spec, args.ctx, args.ubatch, args.device, args.dtype, args.cache_dir,
                            baseline=args.cmd == "baseline", dry_run=True,
                            allow_long_context=args.allow_long_context, attention=args.attention,
                            compute=cell.compute if cell is not None else args.compute)
            if cell is not None:
                print(f"run {cell.name}: tail {args.tail} requested, runs at tail "
                      f"{pair_effective_tail(cell.k, cell.v, cell.tail)} on full-attention layers "
                      f"(printed {tail_label(cell.k, cell.v, cell.tail)})")
            print(f"{args.cmd} {spec.name} ctx {args.ctx} ubatch {args.ubatch}: estimated peak memory")
            print(est.describe())
            try:
                dev, host = capacity(est.device)
                print("free here: " + (f"device {dev / 2**30:.2f} GiB, " if dev is not None else "")
                      + f"host {host / 2**30:.2f} GiB")
            except (AssertionError, RuntimeError) as e:  # estimating a CUDA job on a machine without one
                print(f"free here: unknown ({est.device} not available: {e})")
            return 0
        if args.cmd == "baseline":
            h = torch_engine.run_baseline(spec, args.ctx, chunks, Path(args.out), ubatch=args.ubatch, text=args.text,
                                    device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
                                    compute=args.compute, llama_kld_out=args.llama_kld_out, attention=args.attention)
            print(f"baseline: {h['n_chunks']} chunks x {args.ctx} tokens, {h['tokens_per_s']:.1f} tokens/s -> {args.out}")
            return 0
        if args.cmd == "run":
            from kvarn.stats.metrics import format_llama

            if not Path(args.baseline).is_file():
                raise UsageError(f"--baseline {args.baseline}: no such file; make it with `kvarn baseline`")
            with hold_output(args.out, ["kvarn", *(sys.argv[1:] if argv is None else argv)]):
                s = torch_engine.run_cell(spec, args.ctx, chunks, cell, Path(args.baseline), Path(args.out),
                                    ubatch=args.ubatch, text=args.text, device=args.device, dtype=args.dtype,
                                    cache_dir=args.cache_dir, accounting=args.accounting, attention=args.attention)
            sys.stdout.write(format_llama(s))
            print(f"\nKV cache ({s['memory_accounting']} accounting): {s['kv_total_bytes'] / 2**20:.2f} MiB "
                  f"(body {s['kv_body_bytes'] / 2**20:.2f}, staging {s['kv_staging_bytes'] / 2**20:.2f}, "
                  f"overlay {s['kv_overlay_bytes'] / 2**20:.2f}); {s['tokens_per_s']:.1f} tokens/s; -> {args.out}")
            return 0
    except (UsageError, ValueError, FileNotFoundError, PreflightError, OutputBusy) as e:
        ap.exit(2, f"kvarn {args.cmd}: error: {e}\n")
    return 1

