"""The device run's results (bench/gpu/device_run.py): one JSON line per measured item appended to
`DIR/device_run.jsonl` (flushed and synced) and `DIR/device_run.md` rewritten from it after each,
with the projection of config/article.yaml (`bench.gpu.projection.project` / `markdown`, from the
measured seconds per chunk) as far as the numbers go; a kill keeps every finished line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.gpu.device_plan import MODELS


# --- the results file ------------------------------------------------------------------

class Recorder:
    """Appends one JSON line per item to DIR/device_run.jsonl (synced: a kill keeps it) and
    rewrites DIR/device_run.md from the whole file after each."""

    def __init__(self, results: Path):
        self.jsonl, self.md = results / "device_run.jsonl", results / "device_run.md"

    def add(self, item: dict) -> dict:
        item = {"t": round(time.time(), 1), **item}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(item, default=json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[device_run] {_one_line(item)}", flush=True)
        self.render()
        return item

    def records(self) -> list[dict]:
        if not self.jsonl.is_file():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def render(self) -> None:
        try:
            text = render(self.records())
        except Exception as e:  # the JSON lines are the record; a rendering bug must not stop a step
            text = f"# The device run\n\nRendering failed ({short_error(e)}); device_run.jsonl holds every result.\n"
        tmp = self.md.with_suffix(".md.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.md)


def json_default(x):
    """json.dumps' default for a results line: a tensor or numpy scalar as its number, else its str."""
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _one_line(r: dict) -> str:
    keys = ("phase", "status", "s_per_chunk", "warmup_s", "first_call_s", "per_call_s", "s", "error", "why")
    return f"{r.get('step', '')} {r.get('item', '')}: " + ", ".join(f"{k} {r[k]}" for k in keys if k in r)


def short_error(e: BaseException, n: int = 300) -> str:
    """An exception in one line of at most `n` characters after its type, for a results line."""
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:n]


def compiled_graphs() -> int | None:
    """Graphs dynamo has compiled in this process so far (None if torch no longer counts them)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


# --- the projection and the Markdown ------------------------------------------------------

def measured(records: list[dict]) -> dict[str, dict[str, float]]:
    """measured[model][kind] = seconds per chunk, from the model steps' finished runs."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("step") in MODELS and r.get("kind") and r.get("phase") != "warm-up" and r.get("status") == "ok":
            out.setdefault(r["step"], {})[r["kind"]] = r["s_per_chunk"]
    return out


def projection(records: list[dict]) -> dict:
    """bench.gpu.projection's projection from what is measured so far: {"device", "measured",
    "projection" (its dict) and "markdown"}, or {"error"} where it cannot be made."""
    m = measured(records)
    gpu = next((r.get("gpu") or "" for r in records if r.get("item") == "machine"), "")
    device = "h100" if "H100" in gpu else "h200"
    out = {"device": device, "measured": m}
    if not m:
        return {**out, "error": "nothing measured yet"}
    try:
        from bench.gpu import projection as pj
    except Exception as e:  # absent, or being written
        return {**out, "error": f"bench/gpu/projection.py not importable ({short_error(e, 120)})"}
    try:
        compute = next((r["compute"] for r in records if r.get("compute") in pj.ATTENTION_COMPUTES), "bf16-attn")
        proj = pj.project(device=device, measured=m, compute=compute)
        return {**out, "projection": proj, "markdown": pj.markdown(proj)}
    except Exception as e:
        return {**out, "error": f"bench.gpu.projection failed: {short_error(e)}"}


def _f(x, digits=2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _gib(b) -> str:
    return "" if b is None else f"{b / 2**30:.2f}"


def _status(r: dict) -> str:
    s = r.get("status", "")
    why = r.get("error") or r.get("why")
    return (f"{s}: {why}" if why else s).replace("|", "/")


def _imports_line(imp: dict) -> str:
    if not imp or imp.get("ok") is None:
        return "Import check: not run."
    pkgs = ", ".join(f"{m} {row.get('version') or row.get('dist_version') or 'absent'}"
                     + (f" ({row['from']})" if row.get("from") else "") for m, row in imp.get("packages", {}).items())
    head = "ok" if imp.get("ok") else "**failed**: " + "; ".join(imp.get("problems", []))
    return f"Import check ({imp.get('s', 0):.0f} s): {head}. Found: {pkgs}.".replace("|", "/")


def render(records: list[dict]) -> str:
    """The Markdown of a results file (any prefix of one: a killed run renders what it has)."""
    mach = next((r for r in records if r.get("item") == "machine"), {})
    smoke = mach.get("smoke")
    L = ["# The device run: the study's cell types at its n_ctx, flex at head dim 512, the Triton tests, the "
         "projection", "",
         f"Written by `bench/gpu/device_run.py` from `device_run.jsonl`. Machine: {mach.get('gpu') or 'no GPU (CPU)'}, "
         f"{mach.get('cpus')} CPUs; torch {mach.get('torch')}, triton {mach.get('triton')}, transformers "
         f"{mach.get('transformers')}, flash-linear-attention {mach.get('flash-linear-attention')}; commit "
         f"{mach.get('commit')}; compute {mach.get('compute')}; budget {mach.get('budget_s')} s.", "",
         _imports_line(mach.get("imports", {})), "",
         f"Command: `{mach.get('command', '')}`", ""]
    if smoke:
        L += ["**Smoke run** (tiny shapes on CPU, flex eager): checks the script, measures nothing of the study.", ""]
    for name, n_ctx in MODELS.items():
        L += ["", f"## {1 + list(MODELS).index(name)}. {name} at {n_ctx} (random weights, one chunk per run)", ""]
        load = next((r for r in records if r.get("step") == name and r.get("item") == "load"), None)
        if load:
            ok = load.get("status") == "ok"
            line = f"Model load: {_status(load)}"
            if ok:
                line += f", {load['s']:.1f} s, peak device {_gib(load.get('peak_device_bytes'))} GiB"
            if load.get("linear_attention"):
                line += f"; Gated DeltaNet layers call `{load['linear_attention']}`"
            L += [line + ".", ""]
        L += ["s/chunk: one timed chunk after its warm-up (the warm-up's seconds, compilation included, apart). "
              "Baseline: forward + log-probs to the host + their encoding as the dump's (timed on the first rows, "
              "extrapolated to the chunk's), no disk write. Cells: forward + the kept baseline rows decoded + the "
              "per-token metrics and their summary. A run whose chunk line is missing shows its warm-up's line.", "",
              "| run | cell | warm-up s (compile) | s/chunk | forward s | encode or metrics s | tokens/s | "
              "graphs compiled in chunk | peak device GiB | peak host GiB | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        rows = [r for r in records if r.get("step") == name and r.get("kind")]
        for r in rows:
            if r.get("phase") == "warm-up":
                if any(o.get("item") == r["item"] and o.get("phase") != "warm-up" for o in rows):
                    continue  # the chunk's line has the warm-up's seconds too
                L.append(f"| {r['item']} | {r.get('cell', '')} | {_f(r.get('warmup_s'))} | | | | | | "
                         f"{_gib(r.get('peak_device_bytes'))} (warm-up) | | warm-up {_status(r)}, no chunk line |")
                continue
            other = r.get("encode_s_chunk", r.get("metrics_s"))
            note = (f" (encode timed on {r['encode_rows']} rows)" if "encode_rows" in r else "")
            L.append(f"| {r['item']} | {r.get('cell', '')} | {_f(r.get('warmup_s'))} | "
                     f"{_f(r.get('s_per_chunk'))} | {_f(r.get('forward_s'))} | {_f(other)}{note} | "
                     f"{_f(r.get('tokens_per_s'), 0)} | "
                     f"{r.get('graphs_compiled_in_chunk', '')} | {_gib(r.get('peak_device_bytes'))} | "
                     f"{_gib(r.get('peak_host_bytes'))} | {_status(r)} |")
        L += _step_notes(records, name)
    L += ["", "## 3. flex_attention at head dim 512, compiled (`torch.compile(flex_attention, dynamic=True)`)", "",
          "Random Q/K/V, causal block mask, the last ubatch of the keys. First call: compile + one call. fp32: "
          "operands rounded to TF32 and the kernel's dots in TF32 (`FLOAT32_PRECISION 'tf32'`), as tf32-attn "
          "runs. P rule: the output against `rounded_attention` with P truncated / to nearest (mean and RMS of "
          "the difference over the output's magnitude).", "",
          "| head dim | dtype | keys | queries | heads q/kv | first call s | per call ms | compile s | peak GiB "
          "| P rule | status |",
          "|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in records:
        if r.get("step") == "flex" and r.get("item") != "step":
            opts = " (small blocks)" if r.get("small_blocks") else ""
            heads = "/".join(str(h) for h in r.get("heads", ()))
            pr = r.get("p_rule")
            rule = (f"{pr['closer']} (truncate {pr['truncate']['mean']:.1e} / {pr['truncate']['rms']:.1e}; "
                    f"nearest {pr['nearest']['mean']:.1e} / {pr['nearest']['rms']:.1e})" if pr else "")
            dtype = "float32 (TF32)" if r.get("tf32") else r.get("dtype", "")
            L.append(f"| {r.get('head_dim', '')} | {dtype}{opts} | {r.get('keys', '')} | "
                     f"{r.get('queries', '')} | {heads} | "
                     f"{_f(r.get('first_call_s'))} | {_f(r['per_call_s'] * 1e3 if 'per_call_s' in r else None, 1)} | "
                     f"{_f(r.get('compile_s'))} | {_gib(r.get('peak_device_bytes'))} | {rule} | {_status(r)} |")
    L += _step_notes(records, "flex")
    L += ["", "## 4. The KVarN Triton kernels' GPU tests", ""]
    t = [r for r in records if r.get("step") == "triton"]
    for r in t:
        if r.get("item") == "step":
            L.append(f"* {_status(r)}")
        else:
            L.append(f"* `{r['command']}`: {r['status']} (rc {r['rc']}), {r['passed']} passed, {r['failed']} "
                     f"failed, {r['skipped']} skipped, {r['error']} errors in {r['s']:.0f} s; `{r['summary']}`")
    if not t:
        L.append("* not run yet")
    L += ["", "## 5. Projection (bench/gpu/projection.py, from the seconds per chunk above)", ""]
    proj = projection(records)
    if "markdown" in proj:
        L.append(proj["markdown"].rstrip())
    else:
        L.append(f"Not available: {proj['error']}.")
    L += ["", f"Measured seconds per chunk it reads: `{json.dumps(proj['measured'])}`"
          + (" (tiny smoke models: checks the arithmetic only)" if smoke else "")]
    done = next((r for r in records if r.get("item") == "done"), None)
    stopped = next((r for r in records if r.get("item") == "stopped"), None)
    L += ["", f"Run finished in {done['s']:.0f} s." if done else f"Run stopped: {_status(stopped)}." if stopped
          else "Run stopped at the import check." if mach.get("imports", {}).get("ok") is False
          else "Run not finished (killed, or still running)."]
    return "\n".join(L) + "\n"


def _step_notes(records, step) -> list[str]:
    return [f"\nStep {step}: {_status(r)}." for r in records if r.get("step") == step and r.get("item") == "step"]
