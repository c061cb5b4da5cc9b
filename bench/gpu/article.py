"""The study's article matrix per model, as the GPU benches read it: its n_ctx (`STUDY`,
config/article.yaml) and its chunk count (`STUDY_CHUNKS`: the real tokenizers' counts are not
computable here; these are issue 9's reading, ~4 Qwen chunks at 65,536 and ~17 Gemma chunks at
16,384). bench/gpu/projection.py, bench/gpu/device_run.py and bench/perf/baseline_size.py import
them from here.

The article run this module used to hold (bench/gpu/article.sh) is retired: bench/gpu/device_run.py
measures the same cell types, largest risk first, and keeps each result as it is measured.
"""

STUDY = {"gemma4-31b": 16384, "qwen3.6-27b": 65536}  # name -> the study's n_ctx (config/article.yaml)
STUDY_CHUNKS = {"gemma4-31b": 17, "qwen3.6-27b": 4}
