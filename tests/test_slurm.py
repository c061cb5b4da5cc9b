"""kvarn.plan.slurm: the pre-submission check of Slurm requests against sinfo, on canned sinfo output;
and the model rules' threads inside a Slurm allocation (workflow/rules/common.smk).

The live cluster run (an oversized request stopped before submission) is tests/cluster/slurm.sh.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvarn.plan import slurm

# `sinfo --noheader --Node --format=%P|%N|%c|%m|%G|%l` of the CI test cluster (tests/cluster/slurm.sh)
CI_SINFO = "cpu*|vm|2|23593|gpu:1|1:00:00\ngpu|vm|2|23593|gpu:1|1:00:00\n"

# A heterogeneous site: a default CPU partition, a GPU partition of two node kinds, no limit on `long`.
SITE_SINFO = """\
cpu*|c001|64|256000|(null)|1-00:00:00
cpu*|c002|64|256000|(null)|1-00:00:00
gpu|g001|32|500000|gpu:a100:4(S:0-1)|2-00:00:00
gpu|g002|16|120000|gpu:v100:2,shard:8|2-00:00:00
long|c003|128|1000000|(null)|infinite
"""


def request(rule="cell", partition="gpu", cpus=8, mem_mb=120000, gpus=1, runtime=240):
    return slurm.Request(rule, partition, cpus, mem_mb, gpus, runtime)


@pytest.mark.parametrize("gres, n", [
    ("gpu:1", 1), ("gpu:a100:4(S:0-1)", 4), ("gpu:v100:2,shard:8", 2), ("(null)", 0),
    ("gpu:tesla:2,gpu:a100:4", 6), ("nic:1", 0), ("gpu", 1), ("gpu:a100", 1),
])
def test_gpu_count(gres, n):
    assert slurm.gpu_count(gres) == n


@pytest.mark.parametrize("limit, minutes", [
    ("1:00:00", 60), ("30:00", 30), ("45", 45), ("0:30", 1), ("1-02:00:00", 26 * 60),
    ("2-12", 60 * 60), ("1-02:30", 26 * 60 + 30), ("infinite", None), ("UNLIMITED", None),
])
def test_minutes(limit, minutes):
    assert slurm.minutes(limit) == minutes


def test_minutes_refuses_garbage_by_name():
    with pytest.raises(ValueError, match=r"'soon'.*days-"):
        slurm.minutes("soon")


def test_parse_sinfo_ci():
    nodes = slurm.parse_sinfo(CI_SINFO)
    assert nodes == [slurm.Node("cpu", "vm", 2, 23593, 1, 60, True),
                     slurm.Node("gpu", "vm", 2, 23593, 1, 60, False)]


def test_parse_sinfo_refuses_other_formats_naming_the_line():
    with pytest.raises(ValueError, match=r"'gpu vm 2'.*6 '\|'-separated"):
        slurm.parse_sinfo("gpu vm 2\n")
    with pytest.raises(ValueError, match=r"'gpu\|vm\|two\|1\|gpu:1\|1:00:00'"):
        slurm.parse_sinfo("gpu|vm|two|1|gpu:1|1:00:00")


def test_fitting_requests_pass():
    nodes = slurm.parse_sinfo(CI_SINFO)
    ok = [request(cpus=2, mem_mb=23593, runtime=60), request("row", None, 1, None, 0, None)]
    assert slurm.check(ok, nodes) == []


def test_profile_defaults_on_the_ci_node_name_rule_request_and_node():
    # the shipped profile's cell (8 CPUs, 120000 MB, 1 GPU, 240 min) on the 2-CPU CI node
    errors = slurm.check([request(), request(), request("baseline")], slurm.parse_sinfo(CI_SINFO))
    assert errors == [
        "rule cell (cpus_per_task=8, mem_mb=120000, gpus=1, runtime=240 min): fits no node of "
        "partition 'gpu'; its largest node is vm with 2 CPUs, 23593 MB, 1 GPU",
        "rule baseline (cpus_per_task=8, mem_mb=120000, gpus=1, runtime=240 min): fits no node of "
        "partition 'gpu'; its largest node is vm with 2 CPUs, 23593 MB, 1 GPU",
    ]


@pytest.mark.parametrize("req, error", [
    # one dimension over each node at a time; the node named is the one closest to fitting
    (request(cpus=33, mem_mb=100000, gpus=2), "largest node is g001 with 32 CPUs, 500000 MB, 4 GPUs"),
    (request(cpus=16, mem_mb=500001, gpus=1), "largest node is g001 with 32 CPUs, 500000 MB, 4 GPUs"),
    (request(cpus=16, mem_mb=100000, gpus=5), "largest node is g001 with 32 CPUs, 500000 MB, 4 GPUs"),
    # a GPU job on the default CPU partition (partition not given)
    (request(partition=None, cpus=4, mem_mb=1000, gpus=1, runtime=30),
     "partition 'cpu' (the default); its largest node is c001 with 64 CPUs, 256000 MB, 0 GPUs"),
    (request(partition="a100"), "partition 'a100' does not exist; sinfo lists cpu, gpu, long"),
    (request(runtime=2 * 24 * 60 + 1), "runtime exceeds the time limit of partition 'gpu', 2880 min"),
])
def test_impossible_requests(req, error):
    (got,) = slurm.check([req], slurm.parse_sinfo(SITE_SINFO))
    assert got.startswith(f"rule {req.rule} (cpus_per_task={req.cpus}")
    assert got.endswith(error)


def test_a_request_must_fit_one_node_not_the_partition():
    nodes = slurm.parse_sinfo(SITE_SINFO)
    assert slurm.check([request(cpus=32, mem_mb=500000, gpus=4, runtime=2880)], nodes) == []  # g001 exactly
    # g001 has the memory, g002 the... neither has 33 CPUs: the partition's 48 CPUs do not count
    (error,) = slurm.check([request(cpus=33, mem_mb=100000, gpus=1)], nodes)
    assert "fits no node" in error


def test_the_node_named_is_the_closest_to_holding_the_request():
    # A has more CPUs and memory, B has the GPUs: a 32-CPU GPU job is closer to fitting on B
    nodes = slurm.parse_sinfo("gpu|A|16|500000|(null)|infinite\ngpu|B|8|120000|gpu:2|infinite\n")
    (error,) = slurm.check([request(cpus=32, mem_mb=1000, gpus=1)], nodes)
    assert error.endswith("its largest node is B with 8 CPUs, 120000 MB, 2 GPUs")
    (error,) = slurm.check([request(cpus=32, mem_mb=1000, gpus=0)], nodes)
    assert error.endswith("its largest node is A with 16 CPUs, 500000 MB, 0 GPUs")


def test_no_limit_and_no_runtime():
    nodes = slurm.parse_sinfo(SITE_SINFO)
    assert slurm.check([request(partition="long", cpus=128, gpus=0, runtime=10**6)], nodes) == []
    assert slurm.check([request(runtime=None)], nodes) == []


def test_request_of_follows_the_plugin():
    res = {"slurm_partition": "gpu", "cpus_per_task": 8, "mem_mb": 120000, "gpu": 1, "runtime": 240}
    assert slurm.request_of("cell", res, threads=2) == request()
    # no cpus_per_task: the rule's threads; mem per CPU times CPUs; GPUs through gres
    assert slurm.request_of("x", {"mem_mb_per_cpu": 1000, "gres": "gpu:a100:2"}, threads=4) == \
        slurm.Request("x", None, 4, 4000, 2, None)
    assert slurm.request_of("x", {"cpus_per_gpu": 6, "gpu": 2}, threads=1).cpus == 12
    assert slurm.request_of("x", {"gpu": 0, "cpus_per_task": 2}, threads=1).gpus == 0


ROOT = Path(__file__).resolve().parents[1]


def baseline_threads(tmp_path, env_cpus):
    """threads of the baseline job as a dry run plans it with --cores 64 (workflow/rules/common.smk's MODEL_THREADS)."""
    (tmp_path / "config").symlink_to(ROOT / "config")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT)
    if env_cpus is not None:
        env["SLURM_CPUS_PER_TASK"] = str(env_cpus)
    p = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "64", "--workflow-profile", "none",
                        "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
                        "results/smollm2-135m/ctx512-c1/baseline.kvd",
                        "--configfile", str(ROOT / "tests" / "cluster" / "matrix.yaml"),
                        "--config", f"model_cache={tmp_path / 'models'}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    block = p.stdout.split("rule baseline:")[1].split("\n\n")[0]
    m = re.search(r"threads: (\d+)", block)
    return int(m.group(1)) if m else 1  # Snakemake prints threads only above 1


@pytest.mark.slow
@pytest.mark.parametrize("env_cpus", [None, 3])
def test_model_threads_are_the_allocation_under_slurm(tmp_path, env_cpus):
    # outside Slurm: every core of this machine (at most --cores); in an allocation: its CPUs per task
    want = min(64, os.cpu_count()) if env_cpus is None else env_cpus
    assert baseline_threads(tmp_path, env_cpus) == want


def test_cpus_per_task_reads_the_allocation_only_inside_a_job():
    assert slurm.cpus_per_task({"SLURM_CPUS_PER_TASK": "6"}) == 6
    assert slurm.cpus_per_task({}) is None
    assert slurm.cpus_per_task({"SLURM_CPUS_PER_TASK": ""}) is None
