# Under a cluster executor (workflow/profiles/slurm; README "On a cluster").
#
# Only the model-running rules are submitted as jobs: everything else (text copy, rows,
# summary, paired statistics, report) takes seconds, and as a Slurm job each would pay a
# queue wait and two Snakemake start-ups; they run in the main process instead. Included
# last: it lists the rules defined before it.
SUBMITTED_RULES = ("fetch_model", "baseline", "cell", "decode", "baseline_program", "cell_program")
workflow.localrules(*(r.name for r in workflow.rules if r.name not in SUBMITTED_RULES))


# Before anything is submitted, every job's request is compared with what sinfo reports:
# a request no node of its partition can hold would sit PENDING forever (kvarn.plan.slurm).
onstart:
    if workflow.executor_plugin is not None and workflow.executor_plugin.name == "slurm":
        import subprocess
        from kvarn.plan import slurm as kvs

        try:
            sinfo = subprocess.run(["sinfo", *kvs.SINFO_ARGS], capture_output=True, text=True)
        except FileNotFoundError:
            raise WorkflowError("the Slurm executor needs sinfo (not found on PATH) to check the requests") from None
        if sinfo.returncode != 0:
            raise WorkflowError(f"sinfo {' '.join(kvs.SINFO_ARGS)} failed: {sinfo.stderr.strip()}")
        requests = [kvs.request_of(j.rule.name, j.resources, j.threads)
                    for j in workflow.dag.needrun_jobs() if not j.is_local]
        errors = kvs.check(requests, kvs.parse_sinfo(sinfo.stdout))
        if errors:
            raise WorkflowError(
                "these jobs would wait in the queue forever (sinfo: no node of the partition can hold them); "
                "lower the request or choose another partition in your site profile (README \"On a cluster\"):\n  "
                + "\n  ".join(errors))
