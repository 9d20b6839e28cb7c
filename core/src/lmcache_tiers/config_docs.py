"""Documentation generated from config Structs: ``plugins show`` and the config reference.

Everything comes from msgspec's JSON schema of each Struct, so the reference cannot drift
from the code (a test regenerates ``docs/configuration.md`` and compares).  Field docs
come from ``msgspec.Meta(description=...)``.
"""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from lmcache_tiers.config import (
    LMCACHE_COMMON_UNSUPPORTED,
    LMCACHE_NEUTRAL_VALUES,
    CircuitConfig,
    FrontendConfig,
    L2AdapterConfig,
    L2EvictionConfig,
    ServerConfig,
)
from lmcache_tiers.registry import CONTEST_WAY_OUT, Component, Kind, contest_text

if TYPE_CHECKING:
    from lmcache_tiers.plugins import PluginSet

#: Only shipped plugins go into the committed reference; third-party ones are listed live.
SHIPPED_PREFIX = "lmcache-plugin-"

#: section title of each component kind in the reference
KIND_TITLES: dict[Kind, str] = {
    Kind.L2_ADAPTER: "L2 adapters",
    Kind.STORE_POLICY: "Store policies",
    Kind.PREFETCH_POLICY: "Prefetch policies",
    Kind.EVICTION_POLICY: "Eviction policies",
    Kind.SERDE: "Serdes",
    Kind.FRONTEND: "Front ends",
}

_CONSTRAINT_WORDS = {
    "minimum": ">=",
    "exclusiveMinimum": ">",
    "maximum": "<=",
    "exclusiveMaximum": "<",
    "minLength": "min length",
    "maxLength": "max length",
    "pattern": "matches",
}


class FieldDoc(NamedTuple):
    name: str
    type: str
    default: str
    constraints: str
    doc: str


def _type_name(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_type_name(s, defs) for s in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        items = schema.get("items") or (schema.get("prefixItems") or [{}])[0]
        return f"list[{_type_name(items, defs)}]"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return f"map[str, {_type_name(extra, defs) if isinstance(extra, dict) else 'any'}]"
    return "null" if kind == "null" else str(kind)


def _constraints(schema: dict[str, Any]) -> str:
    parts = [f"{word} {schema[key]}" for key, word in _CONSTRAINT_WORDS.items() if key in schema]
    for option in schema.get("anyOf", []):
        parts.extend(f"{word} {option[key]}" for key, word in _CONSTRAINT_WORDS.items() if key in option)
    return ", ".join(parts)


class UndescribedConfigError(ValueError):
    """A plugin's config Struct msgspec cannot describe (a field of a type it does not
    support, a default it cannot encode): the component's options cannot be listed."""


def component_fields(struct: type[msgspec.Struct]) -> list[FieldDoc]:
    """One FieldDoc per field of ``struct``, in declaration order.

    Raises UndescribedConfigError, one line saying why, for a Struct msgspec has no schema
    of: a third-party plugin's mistake must not stop the listing of the others.
    """
    try:
        schema = msgspec.json.schema(struct)
    except (TypeError, ValueError) as exc:
        # msgspec's reason is several lines; its last one names the type at fault
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise UndescribedConfigError(lines[-1] if lines else type(exc).__name__) from None
    defs = schema.get("$defs", {})
    # The top-level reference names the Struct's own entry: msgspec qualifies the names of
    # two Structs called alike (a plugin's CircuitConfig and core's, of its `circuit` field).
    ref = str(schema.get("$ref", ""))
    body = defs.get(ref.rsplit("/", 1)[-1], schema) if ref else schema
    required = set(body.get("required", []))
    rows = []
    for name, prop in body.get("properties", {}).items():
        if name in required:
            default = "required"
        elif "default" in prop:
            default = json.dumps(prop["default"])
        else:
            default = "(computed)"
        rows.append(
            FieldDoc(name, _type_name(prop, defs), default, _constraints(prop), prop.get("description", ""))
        )
    return rows


def component_doc(component: Component) -> str:
    """The component's documentation as prose: a docstring's continuation lines lose the
    indentation they have in the source (Markdown would render them as a code block)."""
    return inspect.cleandoc(component.doc) if component.doc else ""


def _markdown_table(struct: type[msgspec.Struct], flags: dict[str, list[str]] | None = None) -> list[str]:
    """A Markdown table of ``struct``'s fields; with ``flags`` (field -> serve flags), a
    column naming the command-line flags that set each field."""
    head = [
        "field",
        *(["flag"] if flags is not None else []),
        "type",
        "default",
        "constraints",
        "description",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in component_fields(struct):
        named = [", ".join(f"`{flag}`" for flag in flags.get(f.name, []))] if flags is not None else []
        cells = [f"`{f.name}`", *named, f.type.replace("|", "\\|"), f"`{f.default}`", f.constraints, f.doc]
        lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return lines


#: where the configuration names a policy of each kind: by name only, so a policy's own
#: options keep their defaults (the reference must not read as if they could be set)
_POLICY_NAMED_BY: dict[Kind, str] = {
    Kind.EVICTION_POLICY: "`--eviction-policy` and an adapter's `eviction.eviction_policy`",
    Kind.STORE_POLICY: "`--l2-store-policy`",
    Kind.PREFETCH_POLICY: "`--l2-prefetch-policy`",
}


def policy_options_note(kind: Kind) -> str:
    """For a policy kind: the sentence saying its options run at their defaults; else ""."""
    named_by = _POLICY_NAMED_BY.get(kind)
    if named_by is None:
        return ""
    return (
        f"These options run at their defaults: {named_by} name the policy only, "
        "and no flag, `--config` key or adapter field sets them."
    )


def _lmcache_refusals(config_type: type) -> str:
    """The LMCache fields a component refuses for reasons of its own, one sentence."""
    own: dict[str, str] = getattr(config_type, "lmcache_unsupported", {})
    if not own:
        return ""
    neutral: dict[str, object] = getattr(config_type, "lmcache_neutral_values", {})

    def accepted(name: str) -> str:
        return f" (`{json.dumps(neutral[name])}` accepted)" if name in neutral else ""

    reasons = "; ".join(f"`{name}`{accepted(name)}: {reason}" for name, reason in sorted(own.items()))
    return f"LMCache fields refused here (null is accepted), and why: {reasons}."


def render_config_reference(plugin_set: PluginSet) -> str:
    """Markdown for docs/configuration.md: the server config and every shipped component."""
    from lmcache_tiers.cli.serve_cmd import config_flags

    out = [
        "# Configuration reference",
        "",
        "Generated by `lmcache-tiers plugins reference` from the msgspec schemas; do not edit",
        "by hand (a test fails when this file is stale).",
        "",
        "## Server (`lmcache-tiers serve` flags and `--config` TOML keys)",
        "",
        "TOML keys are the field names (`l1_size_gb`; these top-level ones may be written with",
        "dashes, `[[l2-adapters]]`); the flags are LMCache's server flags (`--l1-size-gb`,",
        "`--l1-read-ttl-seconds`). `l2_adapters` is a list of adapter objects and `frontends` a",
        "list of front-end objects (`[[frontends]]` tables), each with a `type` (below). Values",
        "have the field's type in TOML and JSON alike",
        '(`l1_size_gb = 2`, not `"2"`), numbers are finite (`inf` and `nan` are refused everywhere);',
        "errors name the path (`$.l2_adapters[0].pool_size`).",
        "LMCache flags without a field here: [lmcache-compat.md](lmcache-compat.md).",
        "",
        *_markdown_table(ServerConfig, config_flags()),
        "",
        "## Options common to every L2 adapter",
        "",
        *_markdown_table(L2AdapterConfig),
        "",
        "`eviction` object:",
        "",
        *_markdown_table(L2EvictionConfig),
        "",
        "`circuit` object:",
        "",
        *_markdown_table(CircuitConfig),
        "",
        "Fields LMCache's server reads from every adapter object, where the adapter has no "
        "field of that name nor a reason of its own to refuse it (in its section below): "
        + ", ".join(
            f"`{name}` only as `{json.dumps(LMCACHE_NEUTRAL_VALUES[name])}`"
            for name in sorted(LMCACHE_COMMON_UNSUPPORTED)
            if name in LMCACHE_NEUTRAL_VALUES
        )
        + " (LMCache's defaults: one L1, nothing removed at shutdown, no coordinator to tell) are "
        "accepted; other values, and "
        + ", ".join(
            f"`{name}`" for name in sorted(set(LMCACHE_COMMON_UNSUPPORTED) - set(LMCACHE_NEUTRAL_VALUES))
        )
        + ", are refused with one line saying why. An adapter's own LMCache fields without an "
        'equivalent are refused the same way. Any of them set to null (LMCache\'s "not set") '
        "is accepted and means nothing.",
        "",
        "## Options common to every front end",
        "",
        *_markdown_table(FrontendConfig),
        "",
    ]
    contested = {(each[0].kind, each[0].name.lower()): each for each in plugin_set.registry.contested()}
    for kind in Kind:
        documented: list[tuple[Component, list[Component] | None]] = []
        for first in plugin_set.registry.components(kind):
            claimants = contested.get((kind, first.name.lower()))
            if any(c.plugin.startswith(SHIPPED_PREFIX) for c in claimants or [first]):
                documented += [(c, claimants) for c in claimants or [first]]
        if not documented:
            continue
        out += [f"## {KIND_TITLES[kind]}", ""]
        for component, claimants in documented:
            out += _component_section(component, claimants)
    return "\n".join(out).rstrip() + "\n"


def _component_section(component: Component, claimants: list[Component] | None) -> list[str]:
    """The reference's section of one component; ``claimants``: every component of its
    name when distributions contest it, each documented (the one registered first is
    no more the name's than the others), each section saying that serve refuses it."""
    out = [f"### `{component.name}` ({component.plugin})", ""]
    if claimants is not None:
        out += [
            f"**Contested name:** {contest_text(claimants)}: `serve` refuses a configuration "
            f"that uses `{component.name}` (exit code 2) until one is left; {CONTEST_WAY_OUT}.",
            "",
        ]
    doc = component_doc(component)
    if doc:
        out += [doc, ""]
    refused = _lmcache_refusals(component.config)
    if refused:
        out += [refused, ""]
    try:
        fields = _markdown_table(component.config)
    except UndescribedConfigError as exc:
        fields = [f"Options cannot be listed: {exc}."]
    if len(fields) == 2:  # the header alone
        return [*out, "No options.", ""]
    note = policy_options_note(component.kind)
    return [*out, *([note, ""] if note else []), *fields, ""]
