"""The matrix config against its JSON schema, with an error a person can act on: the value, where
it is (`cells[0].tail`) and what is accepted there, instead of the schema's dump.

The Snakefile calls `check_config` before snakemake's own `validate` (which also fills the
schema's defaults in); kvarn.plan.matrix then makes the checks a schema cannot.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvarn.plan.matrix import MatrixError


def where(path) -> str:
    """`cells[0].tail` from a JSON path (keys and indices); `config` for the top level."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "config"


def accepted(schema: dict) -> str:
    """What a (sub)schema accepts, in words."""
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return ", or ".join(accepted(s) for s in schema[key])
    if "enum" in schema:
        return "one of " + ", ".join("null" if v is None else str(v) for v in schema["enum"])
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if types else []
    words = []
    for t in types:
        if t == "integer" or t == "number":
            w = "an integer" if t == "integer" else "a number"
            if "minimum" in schema:
                w += f" >= {schema['minimum']}"
            if "maximum" in schema:
                w += f" <= {schema['maximum']}"
            if "multipleOf" in schema:
                w += f", a multiple of {schema['multipleOf']}"
            words.append(w)
        elif t == "array":
            w = "a non-empty list" if schema.get("minItems", 0) >= 1 else "a list"
            words.append(w + (f" of {_plural(accepted(schema['items']))}" if "items" in schema else ""))
        elif t == "object":
            props = schema.get("properties")
            words.append("a mapping" + (f" with fields {', '.join(props)}" if props else ""))
        elif t == "string":
            words.append("a string" + (f" matching {schema['pattern']}" if "pattern" in schema else ""))
        elif t == "boolean":
            words.append("true or false")
        elif t == "null":
            words.append("null")
        else:
            words.append(str(t))
    return " or ".join(words) or "see the schema"


def _plural(phrase: str) -> str:
    for one, many in (("an integer", "integers"), ("a number", "numbers"), ("a string", "strings"),
                      ("a mapping", "mappings"), ("a non-empty list", "non-empty lists"), ("a list", "lists")):
        if phrase.startswith(one):
            return many + phrase[len(one):]
    return phrase


def message(error) -> str:
    """One schema error as `place: value is not accepted; accepted: ...`."""
    at = where(error.absolute_path)
    v = error.validator
    if v == "additionalProperties":
        allowed = list(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return (f"{at}: unknown field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}; "
                f"accepted: {', '.join(allowed)}")
    if v == "required":
        return f"{at}: {error.message}; its fields: {', '.join(error.schema.get('properties', {}))}"
    return f"{at}: {error.instance!r} is not accepted; accepted: {accepted(error.schema)}"


def config_errors(config: dict, schema: dict) -> list[str]:
    """Every schema error of `config`, one line each, in the config's order."""
    from jsonschema.validators import validator_for

    cls = validator_for(schema)
    errors = sorted(cls(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    return [message(e) for e in errors]


def check_config(config: dict, schema_path) -> None:
    """Raise MatrixError naming each value the schema refuses, where it is and what is accepted."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = config_errors(config, schema)
    if errors:
        raise MatrixError("config refused by workflow/schemas/config.schema.yaml:\n  " + "\n  ".join(errors))
