"""The config schema as a markdown table, generated from the model (the README embeds it; a test keeps them equal).

    python -m fleet.schema_doc
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from fleet.config import FleetConfig


def _type(ann: Any) -> str:
    text = getattr(ann, "__name__", None) if not getattr(ann, "__args__", None) else None
    text = text or str(ann).replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    return text.replace("|", "\\|")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is not None:
            val = field.default_factory()
            return "" if isinstance(val, BaseModel) else f"`{val!r}`"
        return "required"
    return f"`{field.default!r}`"


_TABLE_LISTS = {"nodes": "one local node", "endpoints": "none"}   # list fields: their default, in words


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        sub = next((t for t in (getattr(f.annotation, "__args__", ()) or (f.annotation,))
                    if isinstance(t, type) and issubclass(t, BaseModel)), None)
        key = prefix + name
        if sub is not None and name in _TABLE_LISTS:
            out.append(f"| `{name}` | list of tables `[[{name}]]` | {_TABLE_LISTS[name]} | {f.description} |")
            out += rows(sub, f"{name}[].")
            continue
        if sub is not None:
            out += rows(sub, key + ".")
            continue
        out.append(f"| `{key}` | {_type(f.annotation)} | {_default(f)} | {f.description} |")
    return out


def schema_markdown() -> str:
    return "\n".join(["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows(FleetConfig)])


if __name__ == "__main__":
    print(schema_markdown())
