"""The grammar of a DSML tool-call block (for runtime/constraint.py): the calls of a request
with strict tools (OpenAI's `strict: true`, Anthropic's), of a forced call, and of tools
offered beside a response format.

The block as V4.1 writes it (and deepseek-recipe renders and parses it):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="NAME">
    <｜DSML｜ parameter name="KEY" string="true">raw text</｜DSML｜ parameter>
    <｜DSML｜ parameter name="KEY" string="false">JSON</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Invokes name only the request's tools. A strict tool's invoke takes its schema's properties in
the schema's order (the required ones always, the others optionally): a string property either
raw (string="true", as the model writes strings: text up to the closing tag, under the
property's enum, pattern or lengths) or as JSON under its subschema (string="false"; the recipe
parses either to the same value); any other property, and a string with a format or several
keywords, as JSON under its subschema only. A tool that is not strict takes any parameters,
each raw text or any JSON.
"""
from __future__ import annotations

import json
from typing import Any

from strata.runtime.constraint import GrammarError

CLOSE = "</｜DSML｜ calls>"
PARAM_END = "</｜DSML｜ parameter>"
# the keywords of a string property that its raw form (string="true") enforces, or that do not
# constrain it; a pattern or lengths alone are enforced raw too (`_raw_regex`)
RAW_STRING_KEYS = {"type", "description", "title", "default", "examples", "enum", "const"}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _param_open(name: str | None, raw: bool) -> str:
    """The parameter's opening tag as Lark: a literal, or (any name) literal + NAME + literal."""
    kind = "true" if raw else "false"
    if name is None:
        return f'"<｜DSML｜ parameter name=\\"" PNAME "\\" string=\\"{kind}\\">"'
    return _lit(f'<｜DSML｜ parameter name="{name}" string="{kind}">')


def _json(schema: Any, defs: dict) -> str:
    sub = dict(schema) if isinstance(schema, dict) else ({} if schema is True else schema)
    if not isinstance(sub, dict):
        raise GrammarError(f"a property schema must be an object, got {schema!r}")
    for key in ("$defs", "definitions"):  # (refs into the tool's schema resolve from here)
        if key in defs and key not in sub:
            sub[key] = defs[key]
    return "%json " + json.dumps(sub, ensure_ascii=False)


def _raw_regex(schema: dict) -> str:
    """The regex a raw string value under a pattern or lengths must match whole (a JSON-schema
    pattern matches anywhere in the string unless anchored)."""
    if "pattern" in schema:
        p = schema["pattern"]
        lead, rest = ("", p[1:]) if p.startswith("^") else ("(?s:.*)", p)
        body, tail = (rest[:-1], "") if rest.endswith("$") and not rest.endswith("\\$") \
            else (rest, "(?s:.*)")
        return lead + "(?:" + body.replace("/", "\\/") + ")" + tail
    return f"(?s:.){{{int(schema.get('minLength', 0))},{schema.get('maxLength', '')}}}"


def _value(key: str, schema: Any, defs: dict, rule: str, rules: list[str]) -> str:
    """The Lark expression of one parameter from its opening tag to its closing one — raw text
    (string="true") where the schema takes the string the model writes raw, or JSON
    (string="false") — adding the rules it needs."""
    end = _lit(PARAM_END)
    as_json = f"{_param_open(key, False)} {_json(schema, defs)} {end}"
    if not (isinstance(schema, dict) and schema.get("type") == "string"):
        return as_json
    rest = set(schema) - RAW_STRING_KEYS
    if not rest and isinstance(schema.get("const"), str):
        raw = f"{_lit(schema['const'])} {end}"
    elif not rest and "enum" in schema:
        if not all(isinstance(v, str) for v in schema["enum"]):
            return as_json
        raw = "(" + " | ".join(_lit(v) for v in schema["enum"]) + f") {end}"
    elif not rest and "const" not in schema:
        raw = "raw_text"
    elif rest == {"pattern"} or (rest and rest <= {"minLength", "maxLength"}):
        rules.append(f"{rule}_raw[lazy]: /{_raw_regex(schema)}/ {end}")
        raw = f"{rule}_raw"
    else:  # (a format, several keywords: the JSON form alone enforces them)
        return as_json
    return f"({_param_open(key, True)} {raw} | {as_json})"


def calls_grammar(tools: list[dict], strict: set[str], lead: str) -> tuple[str, str]:
    """(the Lark expression of a calls block from `lead` — the part of its opening not yet
    written: all of it, the rest after the `｜DSML｜` token, or nothing when the prompt opened
    it — to its end, and the rules it uses). `tools`: Chat Completions function tools."""
    rules, invokes = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        name, schema = fn.get("name"), fn.get("parameters") or {}
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise GrammarError(f"tool {i}: expected a name and a parameters schema")
        head = _lit(f'<｜DSML｜ invoke name="{name}">\n')
        tail = _lit("</｜DSML｜ invoke>\n")
        if name in strict:
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            parts = []
            for k, (key, sub) in enumerate(props.items()):
                rule = f"p{i}_{k}"
                rules.append(f'{rule}: {_value(key, sub, schema, rule, rules)} "\\n"')
                parts.append(rule if key in required else rule + "?")
            body = " ".join(parts) if parts else ""
            if not required:  # (no parameter at all is written as an empty line)
                body = f'({body} | "\\n")' if parts else '"\\n"?'
        else:
            body = '(any_param+ | "\\n")'
        rules.append(f"inv{i}: {head} {body} {tail}")
        invokes.append(f"inv{i}")
    if not invokes:
        raise GrammarError("a tool-call grammar needs at least one tool")
    rules += [
        "invoke: " + " | ".join(invokes),
        f'any_param: ({_param_open(None, True)} raw_text | '
        f'{_param_open(None, False)} %json {{}} {_lit(PARAM_END)}) "\\n"',
        f"raw_text[lazy]: /(?s:.*)/ {_lit(PARAM_END)}",
        'PNAME: /[^"\\n]+/',
    ]
    expr = f"invoke+ {_lit(CLOSE)}"
    return (f"{_lit(lead)} {expr}" if lead else expr), "\n".join(rules) + "\n"
