#!/usr/bin/env bash
# Cancel jobs submitted by submit.sh: terminate each job's process group.
dir=.snakemake/local-submit
for id in "$@"; do
  pid="$(cat "$dir/$id.pid" 2>/dev/null)" || continue
  kill -TERM -- "-$pid" 2>/dev/null || true
done
