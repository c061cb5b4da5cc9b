"""Running a cell: the torch engine (`torch_engine`: BF16 baseline dump, one cell per cache) over what a run
loads (`load`) and the forward it shares with the decode and the benchmarks (`forward`), free-running decode,
per-layer attention error, and the worker that keeps one model loaded across jobs."""
