"""Will each Slurm job fit a node? Checked before anything is submitted.

A request larger than every node of its partition is accepted by sbatch and then sits
PENDING (Reason=PartitionConfig, or PartitionTimeLimit for the wall time) forever while
Snakemake waits without a word. `check` compares each job's request with what `sinfo`
reports and returns one error line per rule that cannot run, naming the rule, the request
and the largest node of the partition. workflow/rules/slurm.smk calls it for every job the
Slurm executor would submit (README "On a cluster").

    nodes = parse_sinfo(subprocess.run(["sinfo", *SINFO_ARGS], ...).stdout)
    errors = check([Request("cell", "gpu", cpus=8, mem_mb=120000, gpus=1, runtime=240)], nodes)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# One line per (partition, node): partition (the default one marked `*`), node, CPUs,
# memory (MB), generic resources, the partition's time limit.
SINFO_ARGS = ("--noheader", "--Node", "--format=%P|%N|%c|%m|%G|%l")


@dataclass(frozen=True)
class Node:
    partition: str
    name: str
    cpus: int
    mem_mb: int
    gpus: int
    time_limit: int | None  # minutes; None: infinite
    default: bool = False  # the partition is the cluster's default


@dataclass(frozen=True)
class Request:
    rule: str
    partition: str | None  # None: the cluster's default partition
    cpus: int
    mem_mb: int | None  # None: no --mem (the node's default)
    gpus: int
    runtime: int | None  # minutes; None: no -t (the partition's default)


def gpu_count(gres: str) -> int:
    """GPUs in a Slurm gres string: 'gpu:4', 'gpu:a100:2(S:0-1),shard:8', '(null)' -> 4, 2, 0."""
    gres = re.sub(r"\([^)]*\)", "", gres)  # socket bindings: (S:0-1)
    total = 0
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 1:
            total += 1
        elif parts[-1].isdigit():
            total += int(parts[-1])
        else:
            total += 1  # gpu:a100 = one of that type
    return total


def minutes(limit: str) -> int | None:
    """A Slurm time limit in minutes (rounded up): '1-02:00:00', '1:00:00', '30:00', '45', 'infinite'."""
    limit = limit.strip()
    if limit.lower() in ("infinite", "unlimited"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit)
    if not m:
        raise ValueError(f"Slurm time limit {limit!r}: expected [days-]hours:minutes:seconds, "
                         "minutes:seconds, minutes or 'infinite'")
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if c is not None:  # hours:minutes:seconds
        seconds = (a * 60 + b) * 60 + c
    elif b is not None:  # minutes:seconds, or days-hours:minutes
        seconds = (a * 60 + b) * 60 if days is not None else a * 60 + b
    else:  # minutes, or days-hours
        seconds = a * 3600 if days is not None else a * 60
    seconds += (days or 0) * 86400
    return -(-seconds // 60)


def parse_sinfo(text: str) -> list[Node]:
    """The nodes of `sinfo --noheader --Node --format=%P|%N|%c|%m|%G|%l` (SINFO_ARGS)."""
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 6:
            raise ValueError(f"sinfo line {line!r}: expected 6 '|'-separated fields "
                             "(partition|node|cpus|memory|gres|timelimit)")
        partition, name, cpus, mem, gres, limit = fields
        try:
            nodes.append(Node(partition.rstrip("*"), name, int(cpus), int(mem.rstrip("+")),
                              gpu_count(gres), minutes(limit), partition.endswith("*")))
        except ValueError as e:
            raise ValueError(f"sinfo line {line!r}: {e}") from None
    return nodes


def _describe(r: Request) -> str:
    parts = [f"cpus_per_task={r.cpus}"]
    if r.mem_mb is not None:
        parts.append(f"mem_mb={r.mem_mb}")
    parts.append(f"gpus={r.gpus}")
    if r.runtime is not None:
        parts.append(f"runtime={r.runtime} min")
    return ", ".join(parts)


def _node_text(n: Node) -> str:
    return f"{n.name} with {n.cpus} CPUs, {n.mem_mb} MB, {n.gpus} GPU{'s' if n.gpus != 1 else ''}"


def fits(r: Request, n: Node) -> bool:
    return r.cpus <= n.cpus and (r.mem_mb is None or r.mem_mb <= n.mem_mb) and r.gpus <= n.gpus


def check(requests: list[Request], nodes: list[Node]) -> list[str]:
    """One error line per rule whose request no node of its partition can hold (first offender per rule)."""
    partitions: dict[str, list[Node]] = {}
    for n in nodes:
        partitions.setdefault(n.partition, []).append(n)
    default = next((n.partition for n in nodes if n.default), None)
    errors, seen = [], set()
    for r in requests:
        if r.rule in seen:
            continue
        part = r.partition or default
        where = f"partition {part!r}" + (" (the default)" if r.partition is None else "")
        if part is None:
            error = "no partition given and the cluster has no default partition"
        elif part not in partitions:
            error = f"{where} does not exist; sinfo lists {', '.join(sorted(partitions)) or 'none'}"
        elif not any(fits(r, n) for n in partitions[part]):
            # the node closest to holding it: most of (CPUs, memory, GPUs) enough, then most CPUs, memory
            largest = max(partitions[part], key=lambda n: (
                (r.cpus <= n.cpus) + (r.mem_mb is None or r.mem_mb <= n.mem_mb) + (r.gpus <= n.gpus), n.cpus, n.mem_mb))
            error = f"fits no node of {where}; its largest node is {_node_text(largest)}"
        elif r.runtime is not None and (limit := partitions[part][0].time_limit) is not None and r.runtime > limit:
            error = f"runtime exceeds the time limit of {where}, {limit} min"
        else:
            continue
        seen.add(r.rule)
        errors.append(f"rule {r.rule} ({_describe(r)}): {error}")
    return errors


def request_of(rule: str, resources, threads: int) -> Request:
    """The request snakemake-executor-plugin-slurm 2.8 turns a job's resources into (sbatch's -p, -c, --mem, --gpus, -t)."""
    get = resources.get
    cpus = get("cpus_per_task") or threads
    if not get("cpus_per_task") and get("cpus_per_gpu"):
        cpus = get("cpus_per_gpu") * max(1, int(get("gpu") or 0))
    mem = get("mem_mb")
    if not mem and get("mem_mb_per_cpu"):
        mem = get("mem_mb_per_cpu") * cpus
    gpus = int(get("gpu") or 0) or (gpu_count(str(get("gres"))) if get("gres") else 0)
    return Request(rule, get("slurm_partition") or None, int(max(1, cpus)), int(mem) if mem else None, gpus,
                   int(get("runtime")) if get("runtime") else None)


def cpus_per_task(environ=None) -> int | None:
    """The CPUs of this process's Slurm allocation per task (SLURM_CPUS_PER_TASK, the profile's
    cpus_per_task), or None outside a Slurm job. Without CPU binding the cores a job sees are
    the whole node's, so a model job sizes its threads from this instead."""
    raw = (os.environ if environ is None else environ).get("SLURM_CPUS_PER_TASK", "")
    return int(raw) if raw.isdigit() else None
