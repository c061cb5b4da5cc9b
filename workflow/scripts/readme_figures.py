"""Copy a run's figure PNGs (and Markdown tables) into docs/figures/ for the README.

    .venv/bin/python workflow/scripts/readme_figures.py [--results results] [--dest docs/figures] [--model NAME ...]

Writes docs/figures/{model}-{figure}.png for every figure of kvarn.report and
docs/figures/{model}-table.md; by default for every model under results/figures/.
Run it after `snakemake` (or `make run`) has built the report targets. Not a rule: the
README's images are committed, results/ is not.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvarn.atomic import atomic_path  # noqa: E402

FIGURES = ("pareto", "same_width", "tail_effect", "tail_sweep", "heatmap", "position", "distribution", "ranked")


def copy(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="results", help="the run's results directory (default: results)")
    ap.add_argument("--dest", default="docs/figures", help="where the README looks (default: docs/figures)")
    ap.add_argument("--model", action="append", help="a model to copy (repeatable; default: every model)")
    args = ap.parse_args(argv)
    figdir = Path(args.results) / "figures"
    models = args.model or (sorted(p.name for p in figdir.iterdir() if p.is_dir()) if figdir.is_dir() else [])
    if not models:
        print(f"no figures under {figdir}; build them first: snakemake --cores 1 (or make run)", file=sys.stderr)
        return 1
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    missing = []
    for model in models:
        pairs = [(figdir / model / f"{f}.png", dest / f"{model}-{f}.png") for f in FIGURES]
        pairs.append((Path(args.results) / "tables" / f"{model}.md", dest / f"{model}-table.md"))
        for src, dst in pairs:
            if src.is_file():
                copy(src, dst)
                print(f"{src} -> {dst}")
            else:
                missing.append(str(src))
    if missing:
        print("missing (build them with snakemake first): " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
