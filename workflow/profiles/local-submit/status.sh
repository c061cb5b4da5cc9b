#!/usr/bin/env bash
# Status of a job submitted by submit.sh: running, success or failed (one line).
dir=.snakemake/local-submit
id="$1"
if [ -f "$dir/$id.rc" ]; then
  [ "$(cat "$dir/$id.rc")" = 0 ] && echo success || echo failed
elif kill -0 "$(cat "$dir/$id.pid" 2>/dev/null)" 2>/dev/null; then
  echo running
else
  echo failed  # gone without an exit status: killed
fi
