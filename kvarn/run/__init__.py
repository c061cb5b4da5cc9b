"""Running a cell: the teacher-forced engine (BF16 baseline dump, one cell per cache), free-running decode,
per-layer attention error, and the worker that keeps one model loaded across jobs."""
