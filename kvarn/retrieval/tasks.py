"""Seeded synthetic retrieval tasks, built in token space, and their JSONL files (torch-free).

Owns the three task kinds (`TASKS`), their templates, `make_tasks` (one (task, context) set:
every depth × prompt) and `write_tasks` / `read_tasks`.

A prompt is `[BOS] + intro + haystack + question`, assembled from separately tokenized pieces so
that the needle's token span is known exactly; its length is `context − gen_tokens` tokens for
every prompt of a (task, context) (so they batch without padding, and prompt + greedy answer fill
the context exactly, as a decode's prompt and generation do). The haystack is a stream of units
(filler sentences), cut at its front to the exact length, with the needles
inserted at unit boundaries:

* `passkey`  — one 5-digit pass key in repeated filler; asked for at the end.
* `multikey` — four pass keys, each of a door of another colour, in the filler; one asked for.
  The asked needle is at the requested depth, the three others at seeded random depths.
* `kv`       — eight key–value records, `The value of amber-falcon is 48213.` (keys: two words,
  values: 5 digits), in the filler; one asked for, at the requested depth, the others at seeded
  random depths. (A haystack of nothing but records was tried first: SmolLM2 with the exact cache
  missed the asked value at 256 tokens, as a `key: value` list and as sentences, so the records
  went into the filler like the pass keys.)

Depth d ∈ [0, 1]: the asked needle starts at the unit boundary nearest to d · (H − L) tokens into
the haystack (H the haystack's length, L the needle's): 0 right after the intro, 1 right before
the question. Each record stores its candidates (the asked value first, then the other values the
prompt states: none for `passkey`, 3 for `multikey`, 7 for `kv`) with their token ids
(`answer_text`, tokenized alone), the realized span (`needle_start`, `needle_end`: token indices
into `input_ids`, end exclusive) and `distance` = prompt length − needle_end, the tokens between
the needle and the end of the prompt.

Seeds: every (task, context, depth, prompt index) draws from its own generator,
`numpy.random.default_rng([seed, task code, context, depth code, prompt index])`, all from values,
none from a list position (`prompt_seed`: the task code from the task's name, the depth code
round(depth · 10⁶)), so adding or reordering depths, tasks or contexts leaves the other prompts as
they were; ids name the values too (`{task}-c{context}-d{depth}-p{prompt index}`). The tokenizer is any object with
`encode(text, add_special_tokens=False)` and `decode(ids)` (transformers' tokenizers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvarn.files.atomic import write_text

TASKS = ("passkey", "multikey", "kv")
# Bump when a template or the construction changes: the tasks (and every answer) are made again.
# 2: seeds and ids from the depth's and the task's values, not their list positions
# 3: every record lists its candidates (the asked value, then the other values in the prompt) and their token ids
TASK_VERSION = 3
MULTIKEY_KEYS = 4
KV_KEYS = 8

FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again.")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
ADJECTIVES = ("amber", "bold", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lunar", "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "urban", "vivid",
              "wild", "young", "zesty", "brisk", "cosy", "deep", "early", "fresh")
NOUNS = ("falcon", "river", "maple", "harbor", "lantern", "meadow", "pebble", "canyon", "violin", "garden",
         "comet", "forest", "island", "saddle", "tunnel", "willow", "anchor", "barrel", "candle", "dragon",
         "engine", "feather", "glacier", "hammer", "jacket", "kettle", "ladder", "mirror", "needle", "orchard")

INTRO = {
    "passkey": "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the pass key.",
    "multikey": "There are several pass keys hidden inside a lot of irrelevant text, each the pass key of a door "
                "of another colour. Find them and memorize them. I will quiz you about one of them.",
    "kv": "There are several keys, each with its value, hidden inside a lot of irrelevant text. Find them and "
          "memorize them. I will quiz you about one of them.",
}


def needle_text(task: str, key: str, value: str) -> str:
    """The sentence that states a task's fact (the needle), as placed in the filler."""
    if task == "passkey":
        return f" The pass key is {value}. Remember it. {value} is the pass key."
    if task == "multikey":
        return f" The pass key of the {key} door is {value}. Remember it. {value} is the pass key of the {key} door."
    return f" The value of {key} is {value}."


def question_text(task: str, key: str) -> str:
    """The question that ends a task's prompt, asking for `key`'s value."""
    if task == "passkey":
        return " What is the pass key? The pass key is"
    if task == "multikey":
        return f" What is the pass key of the {key} door? The pass key of the {key} door is"
    return f" What is the value of {key}? The value of {key} is"


def answer_text(value: str) -> str:
    """A value as the answer continues the question ("… The pass key is" + " 48213"): the candidate
    whose teacher-forced log-probability the cell job measures (`kvarn.retrieval.run`)."""
    return f" {value}"


def _check(task, context, depths, prompts, seed, gen_tokens) -> None:
    if task not in TASKS:
        raise ValueError(f"retrieval task {task!r} is unknown; accepted: {', '.join(TASKS)}")
    for name, x, lo in (("context", context, 64), ("prompts", prompts, 1), ("seed", seed, 0),
                        ("gen_tokens", gen_tokens, 1)):
        if isinstance(x, bool) or not isinstance(x, int) or x < lo:
            raise ValueError(f"retrieval {name} must be an integer >= {lo}, got {x!r}")
    if not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"retrieval depths must be a non-empty list of numbers in [0, 1], got {depths!r}")


def _boundaries(units: list[list[int]], cut: int) -> list[int]:
    """Unit boundaries of the stream cut by `cut` tokens at its front, as offsets into the cut stream."""
    out, pos = [0], 0
    for u in units:
        pos += len(u)
        if pos - cut > 0:
            out.append(pos - cut)
    return out


def make_prompt(encode, bos_id, task: str, n_prompt: int, depth: float, rng) -> dict:
    """One prompt of exactly `n_prompt` tokens: input_ids, answer, needle span, the asked key."""
    enc = lambda text: list(encode(text))  # noqa: E731
    n_keys = {"multikey": MULTIKEY_KEYS, "kv": KV_KEYS}.get(task, 1)
    values = [str(v) for v in rng.choice(np.arange(10000, 100000), size=n_keys, replace=False)]
    if task == "multikey":
        keys = [str(c) for c in rng.choice(COLOURS, size=n_keys, replace=False)]
    elif task == "kv":
        pairs = rng.choice(len(ADJECTIVES) * len(NOUNS), size=n_keys, replace=False)
        keys = [f"{ADJECTIVES[q // len(NOUNS)]}-{NOUNS[q % len(NOUNS)]}" for q in pairs]
    else:
        keys = [""]
    needles = [enc(needle_text(task, k, v)) for k, v in zip(keys, values)]
    prefix = ([bos_id] if bos_id is not None else []) + enc(INTRO[task])
    suffix = enc(question_text(task, keys[0]))
    hay = n_prompt - len(prefix) - len(suffix)
    need = sum(map(len, needles))
    if hay < need + 8:
        raise ValueError(f"retrieval task {task}: a prompt of {n_prompt} tokens leaves {hay} for the haystack, "
                         f"fewer than its needles' {need} + 8; use a larger context")
    # the filler units, long enough to cut: filler sentences in turn, or key-value records
    units: list[list[int]] = []
    total, i = 0, int(rng.integers(len(FILLER)))
    while total < hay - need + 64:
        units.append(enc(FILLER[i % len(FILLER)]))
        i += 1
        total += len(units[-1])
    fill = hay - need  # filler tokens kept
    cut = total - fill
    stream = [t for u in units for t in u][cut:]
    bounds = _boundaries(units, cut)
    # distractor needles at distinct random boundaries, then the asked one nearest its depth
    taken: dict[int, list[int]] = {}
    for j in range(1, n_keys):
        free = [b for b in bounds if b not in taken]
        taken[int(rng.choice(free))] = needles[j]

    def start_of(b):  # final haystack offset of a needle inserted at filler boundary b (before any taken there)
        return b + sum(len(n) for q, n in taken.items() if q < b)

    target = depth * (hay - len(needles[0]))
    ask = min((b for b in bounds if b not in taken), key=lambda b: (abs(start_of(b) - target), b))
    taken[ask] = needles[0]
    hay_ids: list[int] = []
    prev = 0
    for b in sorted(taken):
        hay_ids += stream[prev:b] + taken[b]
        prev = b
    hay_ids += stream[prev:]
    ids = prefix + hay_ids + suffix
    assert len(ids) == n_prompt, (len(ids), n_prompt)
    start = len(prefix) + start_of(ask)
    assert ids[start : start + len(needles[0])] == needles[0]
    return {"input_ids": ids, "answer": values[0], "key": keys[0], "needle_start": start,
            "needle_end": start + len(needles[0]), "n_keys": n_keys, "values": values}


def prompt_seed(seed: int, task: str, context: int, depth: float, prompt: int) -> list[int]:
    """The entropy of one prompt's generator, from values only: the task's name (its first 4 bytes
    of SHA-256), the context, the depth (round(depth · 10⁶)) and the prompt index."""
    import hashlib

    code = int.from_bytes(hashlib.sha256(task.encode()).digest()[:4], "big")
    return [seed, code, context, round(float(depth) * 1_000_000), prompt]


def make_tasks(tokenizer, bos_id, task: str, context: int, depths, prompts: int, seed: int = 0,
               gen_tokens: int = 8) -> list[dict]:
    """Every prompt of one (task, context): depths × prompts records, ordered by (depth, prompt).

    Each prompt is `context − gen_tokens` tokens long, so the greedy answer of `gen_tokens`
    tokens ends exactly at `context`. `bos_id`: the BOS id the model's tokenizer prepends, or
    None."""
    _check(task, context, depths, prompts, seed, gen_tokens)
    n_prompt = context - gen_tokens

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    out = []
    for di, depth in enumerate(depths):
        for pi in range(prompts):
            rng = np.random.default_rng(prompt_seed(seed, task, context, depth, pi))
            rec = make_prompt(encode, bos_id, task, n_prompt, float(depth), rng)
            out.append({
                "id": f"{task}-c{context}-d{float(depth):g}-p{pi}", "task": task, "context": context, "depth": float(depth),
                "depth_index": di, "prompt_index": pi, "seed": seed, "gen_tokens": gen_tokens,
                "n_prompt": n_prompt, "answer": rec["answer"], "key": rec["key"], "n_keys": rec["n_keys"],
                "needle_start": rec["needle_start"], "needle_end": rec["needle_end"],
                "distance": n_prompt - rec["needle_end"], "task_version": TASK_VERSION,
                "candidates": rec["values"], "candidate_ids": [encode(answer_text(v)) for v in rec["values"]],
                "needle": tokenizer.decode(rec["input_ids"][rec["needle_start"] : rec["needle_end"]]),
                "prompt": tokenizer.decode(rec["input_ids"]), "input_ids": rec["input_ids"],
            })
    return out


def write_tasks(path, records: list[dict]) -> None:
    """One JSON object per line, written atomically (kvarn.files.atomic)."""
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_tasks(path) -> list[dict]:
    """The records of a task (or answer) JSONL file; a line that is not JSON is named."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
    return out
