"""The `kvarn` command (`kvarn = kvarn.cli:main`): fetch a model, write a BF16 baseline, run one
cache cell, compute a cache's memory, compare two cells, advise a configuration from a run's
results, list formats. `parser` holds the arguments, `commands` the subcommands with more than one
library call, `dispatch` the entry point. Bad values exit with code 2 and a message naming the
value and what is accepted."""

from kvarn.cli.dispatch import main

__all__ = ["main"]
