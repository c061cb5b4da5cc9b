"""Performance benchmarks: speed, memory and sizes of kvarn's paths (bench/perf/README.md)."""
