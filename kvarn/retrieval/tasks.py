"""Seeded synthetic retrieval tasks, built in token space, and their JSONL files (torch-free).

Owns the task kinds (`TASKS`: `LEGACY_TASKS` passkey, multikey, kv and RULER's families
`RULER_TASKS`) and `TASK_VERSION`, their templates (`needle_text`, `question_text`,
`answer_text`), the prompt assembly (`make_prompt`, `make_ruler_prompt`: `[BOS] + intro +
haystack + question` from separately tokenized pieces, so the needle's span is exact), each
prompt's generator (`prompt_seed`, from values only), the answer length (`answer_tokens`,
`ANSWER_TOKENS`), `make_tasks` (one (task, context) set: every depth × prompt) and
`write_tasks` / `read_tasks`. What the haystack and the needles are made of (filler, Wikitext
sentences, keys, values, units) is `kvarn.retrieval.haystack`'s; grading is
`kvarn.retrieval.score.grade`.

Why (the tasks, depth, length, seeds, candidates, RULER's wording): docs/notes/retrieval.md "Design".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kvarn.files.atomic import write_text
from kvarn.retrieval.haystack import ADJECTIVES, COLOURS, FILLER, NOUNS, boundaries, draw_values, haystack_units, words

LEGACY_TASKS = ("passkey", "multikey", "kv")
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_uuid",
               "niah_multivalue", "niah_multiquery", "vt")
TASKS = LEGACY_TASKS + RULER_TASKS
# Bump when a template or the construction changes: the tasks (and every answer) are made again.
# 2: seeds and ids from the depth's and the task's values, not their list positions
# 3: every record lists its candidates (the asked value, then the other values in the prompt) and their token ids
# 4: RULER's task families (and a task's own answer length)
TASK_VERSION = 4
MULTIKEY_KEYS = 4
KV_KEYS = 8

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
    bounds = boundaries(units, cut)
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


# ---------------------------------------------------------------- RULER's task families

RULER_KEYS = 4  # multi-key: 1 asked + 3 distractors; multi-value: 4 values; multi-query: 4 keys asked
VT_VARIABLES = 5  # one chain, four hops (RULER's vt: num_chains 1, num_hops 4)
# the shortest greedy answer of a task: room for its values as SmolLM2's and Gemma 3's tokenizers
# spell them (a digit a token; a UUID up to 36 tokens) and a separator between them
ANSWER_TOKENS = {"niah_single_1": 12, "niah_single_2": 12, "niah_single_3": 40, "niah_multikey_1": 12,
                 "niah_multikey_uuid": 40, "niah_multivalue": 48, "niah_multiquery": 48, "vt": 32}
VALUE_KIND = {"niah_single_3": "uuid", "niah_multikey_uuid": "uuid", "vt": "variable"}  # else "number"

def ruler_kind(task: str) -> str:
    """What a RULER task's values are: "number" (7 digits), "uuid" or "variable" (vt's names)."""
    return VALUE_KIND.get(task, "number")


def answer_tokens(task: str, gen_tokens: int) -> int:
    """The greedy answer's length of `task`: max(gen_tokens, the task's own minimum)."""
    return max(gen_tokens, ANSWER_TOKENS.get(task, 0))


def ruler_texts(task: str, rng) -> dict:
    """A RULER task's texts from its generator: intro, needles (the first at the depth), question
    (ending with the answer prefix), the values that must all appear (`answers`, in the candidate's
    order), the candidates (strings) and the asked key. RULER's `synthetic.yaml` wording."""
    kind = ruler_kind(task)
    if task == "vt":
        names: list[str] = []
        while len(names) < VT_VARIABLES:
            name = "".join(chr(65 + int(c)) for c in rng.integers(0, 26, size=5))
            if name not in names:
                names.append(name)
        value = str(int(rng.integers(10000, 100000)))
        needles = [f" VAR {names[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return {"intro": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n",
                "needles": needles, "key": value, "answers": names,
                "question": f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                            f"Answer: According to the chain(s) of variable assignment in the text above, "
                            f"{VT_VARIABLES} variables are assigned the value {value}, they are:",
                "candidates": [", ".join(names)], "placement": "chain"}
    noun = "uuids" if kind == "uuid" else "numbers"
    intro = (f"Some special magic {noun} are hidden within the following text. Make sure to memorize it. "
             f"I will quiz you about the {noun} afterwards.\n")
    n_keys = RULER_KEYS if task in ("niah_multikey_1", "niah_multikey_uuid", "niah_multiquery") else 1
    n_values = RULER_KEYS if task == "niah_multivalue" else n_keys
    keys = words(rng, n_keys)
    values = draw_values(rng, kind, n_values)
    key_of = keys if n_keys > 1 else keys * n_values
    needles = [f" One of the special magic {noun} for {k} is: {v}." for k, v in zip(key_of, values)]
    if task == "niah_multiquery":
        query, answers = ", ".join(keys[:-1]) + ", and " + keys[-1], values
    else:
        query, answers = keys[0], (values if task == "niah_multivalue" else values[:1])
    question = (f"\nWhat are all the special magic {noun} for {query} mentioned in the provided text? "
                f"The special magic {noun} for {query} mentioned in the provided text are")
    if len(answers) > 1:
        candidates = [", ".join(answers)]  # the whole list (multi-value: reordered as the text states them)
    else:
        candidates = values  # the asked value, then the other keys' (the distractors)
    return {"intro": intro, "needles": needles, "key": query, "answers": answers, "question": question,
            "candidates": candidates, "placement": "random"}


def make_ruler_prompt(encode, bos_id, task: str, n_prompt: int, depth: float, rng) -> dict:
    """One RULER prompt of exactly `n_prompt` tokens: `[BOS] + intro + haystack + question`, the
    needles at haystack unit boundaries, the first (the asked one) nearest depth · (haystack −
    its length); the others ("random") at distinct seeded boundaries, or ("chain", vt) at sorted
    seeded boundaries after the first, in order (several at one boundary follow each other)."""
    enc = lambda text: list(encode(text))  # noqa: E731
    t = ruler_texts(task, rng)
    needles = [enc(n) for n in t["needles"]]
    prefix = ([bos_id] if bos_id is not None else []) + enc(t["intro"])
    suffix = enc(t["question"])
    hay = n_prompt - len(prefix) - len(suffix)
    need = sum(map(len, needles))
    if hay < need + 8:
        raise ValueError(f"retrieval task {task}: a prompt of {n_prompt} tokens leaves {hay} for the haystack, "
                         f"fewer than its needles' {need} + 8; use a larger context")
    units = haystack_units(enc, task, rng, hay - need + 64)
    total = sum(map(len, units))
    fill = hay - need
    cut = total - fill
    stream = [x for u in units for x in u][cut:]
    bounds = boundaries(units, cut)
    if len(bounds) < len(needles):
        raise ValueError(f"retrieval task {task}: a prompt of {n_prompt} tokens leaves {fill} haystack tokens, "
                         f"{len(bounds)} sentence boundaries for its {len(needles)} needles; use a larger context")
    taken: dict[int, list[int]] = {}  # boundary -> needle indices, in order
    if t["placement"] == "chain":
        ask = min(bounds, key=lambda b: (abs(b - depth * fill), b))
        after = [b for b in bounds if b >= ask]
        hops = sorted(int(b) for b in rng.choice(after, size=len(needles) - 1, replace=True))
        taken[ask] = [0]
        for j, b in enumerate(hops, 1):
            taken.setdefault(b, []).append(j)
    else:
        for j in range(1, len(needles)):
            free = [b for b in bounds if b not in taken]
            taken[int(rng.choice(free))] = [j]

        def start_of(b):  # final haystack offset of a needle inserted at boundary b (before any taken there)
            return b + sum(len(needles[i]) for q, js in taken.items() if q < b for i in js)

        target = depth * (hay - len(needles[0]))
        ask = min((b for b in bounds if b not in taken), key=lambda b: (abs(start_of(b) - target), b))
        taken[ask] = [0]
    hay_ids: list[int] = []
    spans: list[list[int]] = [[0, 0] for _ in needles]
    prev = 0
    for b in sorted(taken):
        hay_ids += stream[prev:b]
        for j in taken[b]:
            at = len(prefix) + len(hay_ids)
            spans[j] = [at, at + len(needles[j])]
            hay_ids += needles[j]
        prev = b
    hay_ids += stream[prev:]
    ids = prefix + hay_ids + suffix
    assert len(ids) == n_prompt, (len(ids), n_prompt)
    for (a, e), n in zip(spans, needles):
        assert ids[a:e] == n
    if task == "niah_multivalue":  # the values as the text states them, first to last
        t["answers"] = [v for _, v in sorted(zip((a for a, _ in spans), t["answers"]))]
        t["candidates"] = [", ".join(t["answers"])]
    return {"input_ids": ids, "answer": ", ".join(t["answers"]), "answers": t["answers"], "key": t["key"],
            "needle_start": spans[0][0], "needle_end": spans[0][1], "spans": spans, "n_keys": len(needles),
            "values": t["candidates"]}


def prompt_seed(seed: int, task: str, context: int, depth: float, prompt: int) -> list[int]:
    """The entropy of one prompt's generator, from values only: the task's name (its first 4 bytes
    of SHA-256), the context, the depth (round(depth · 10⁶)) and the prompt index."""

    code = int.from_bytes(hashlib.sha256(task.encode()).digest()[:4], "big")
    return [seed, code, context, round(float(depth) * 1_000_000), prompt]


def make_tasks(tokenizer, bos_id, task: str, context: int, depths, prompts: int, seed: int = 0,
               gen_tokens: int = 8) -> list[dict]:
    """Every prompt of one (task, context): depths × prompts records, ordered by (depth, prompt).

    Each prompt is `context − g` tokens long (g = `answer_tokens(task, gen_tokens)`, stored as the
    record's `gen_tokens`), so the greedy answer of g tokens ends exactly at `context`. `bos_id`: the BOS id the model's tokenizer prepends, or
    None. `tokenizer`: any object with `encode(text, add_special_tokens=False)` and `decode(ids)`
    (transformers' tokenizers). `needle_start`, `needle_end`: the asked needle's token indices into
    `input_ids`, end exclusive; `distance` = `n_prompt` − `needle_end`; a RULER task's record also
    has `answers` and `spans` (every needle's [start, end))."""
    _check(task, context, depths, prompts, seed, gen_tokens)
    gen_tokens = answer_tokens(task, gen_tokens)
    n_prompt = context - gen_tokens
    build = make_ruler_prompt if task in RULER_TASKS else make_prompt

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    out = []
    for di, depth in enumerate(depths):
        for pi in range(prompts):
            rng = np.random.default_rng(prompt_seed(seed, task, context, depth, pi))
            rec = build(encode, bos_id, task, n_prompt, float(depth), rng)
            extra = {"answers": rec["answers"], "spans": rec["spans"]} if task in RULER_TASKS else {}
            out.append({
                "id": f"{task}-c{context}-d{float(depth):g}-p{pi}", "task": task, "context": context, "depth": float(depth),
                "depth_index": di, "prompt_index": pi, "seed": seed, "gen_tokens": gen_tokens,
                "n_prompt": n_prompt, "answer": rec["answer"], "key": rec["key"], "n_keys": rec["n_keys"], **extra,
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
