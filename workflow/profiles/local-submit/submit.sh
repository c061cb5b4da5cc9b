#!/usr/bin/env bash
# Submit: run the jobscript (last argument) in the background, detached; print its id.
# The exit status lands in .snakemake/local-submit/<id>.rc for status.sh.
set -euo pipefail
jobscript="${@: -1}"
dir=.snakemake/local-submit
mkdir -p "$dir"
id="$(date +%s%N)-$$"
setsid bash -c 'bash "$1"; echo $? > "$2.rc.tmp" && mv "$2.rc.tmp" "$2.rc"' _ "$jobscript" "$dir/$id" \
  > "$dir/$id.out" 2>&1 < /dev/null &
echo $! > "$dir/$id.pid"
echo "$id"
