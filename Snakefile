# kvarn: how much does a quantized KV cache damage a language model?
# One cell of the matrix = one path; see docs/notes/workflow.md and config/README.md.
import sys

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, workflow.basedir)  # kvarn/ beside this file, venv or not


configfile: "config/matrix.yaml"


# `--config allow_unpinned=true` reaches here as the string "true" (snakemake reads only True/False
# as booleans), so the documented spelling is taken as the boolean it means.
if config.get("allow_unpinned") in ("true", "false"):
    config["allow_unpinned"] = config["allow_unpinned"] == "true"


from kvarn.plan.config_check import check_config

# A value the schema refuses is named with where it is and what is accepted (cells[0].tail: -3 ...);
# snakemake's validate then fills in the schema's defaults.
check_config(config, f"{workflow.basedir}/workflow/schemas/config.schema.yaml")
validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
wildcard_constraints:
    model=kvp.MODEL_PATTERN,
    n_ctx=r"\d+",
    chunks=kvp.CHUNKS_PATTERN,
    k=kvp.TYPE_PATTERN,
    v=kvp.TYPE_PATTERN,
    tail=r"\d+",
    opts=kvp.OPTS_PATTERN,
    bopts=kvp.BASELINE_OPTS_PATTERN,  # a baseline per compute path: "", -llamacpp_cpu, -bf16_attn, -tf32_attn
    source_key=r"[0-9a-f]{8}",
    prompts=r"\d+",
    tokens=r"\d+",
    sampling=kvp.SAMPLING_PATTERN,


include: "workflow/rules/models.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/baseline.smk"
include: "workflow/rules/cells.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/paired.smk"
include: "workflow/rules/decode.smk"
include: "workflow/rules/retrieval.smk"
include: "workflow/rules/perlayer.smk"
include: "workflow/rules/slurm.smk"  # last: it reads the rules above


rule all:
    default_target: True
    input:
        all_targets(),
