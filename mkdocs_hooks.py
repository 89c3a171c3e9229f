"""mkdocs hooks (mkdocs.yml `hooks:`) and a griffe extension (mkdocstrings' `extensions:`).

The navigation is found from docs/ without a `nav:` list, and mkdocs titles a directory's
section by its name: `on_nav` gives sections the titles their names cannot.

An Args entry of a docstring may name several parameters that share a description
(`src, dst: ...`), which griffe reads as one parameter of an unknown name and renders with
no type. `SharedParameters` gives each of those names its own row of the parameter table,
with its type and default from the signature, and warns (which fails `mkdocs build
--strict`) about any rendered parameter that is not in the signature or has no type.
"""

from __future__ import annotations

import logging
from typing import Any

import griffe

SECTION_TITLES = {"Api": "API reference"}
logger = logging.getLogger("mkdocs.plugins.zarrckpt")


def on_nav(nav: Any, **_: Any) -> Any:
    for item in nav.items:
        if item.is_section and item.title in SECTION_TITLES:
            item.title = SECTION_TITLES[item.title]
    return nav


def entry_names(name: str) -> list[str]:
    """The parameter names an Args entry's name part lists: `"src, dst"` -> `["src", "dst"]`."""
    return [part.strip() for part in name.split(",") if part.strip()]


class SharedParameters(griffe.Extension):
    """Splits each multi-name Args entry into one entry per parameter, once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **_: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                _split(obj, obj.docstring.parsed)


def _objects(module: griffe.Module) -> list[griffe.Object]:
    """Every function and class of `module`, its submodules and its classes (aliases are
    reached at their targets, in the module that defines them)."""
    found: list[griffe.Object] = []
    for member in module.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Module):
            found += _objects(member)
        elif isinstance(member, griffe.Class):
            found += [member, *(m for m in member.members.values()
                                if not m.is_alias and isinstance(m, griffe.Function))]
        elif isinstance(member, griffe.Function):
            found.append(member)
    return found


def _split(obj: griffe.Object, sections: list[griffe.DocstringSection]) -> None:
    try:
        signature = obj.parameters  # a class's are its __init__'s
    except AttributeError:
        return
    for section in sections:
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        rows = []
        for entry in section.value:
            for name in entry_names(entry.name):
                parameter = signature[name] if name in signature else None
                annotation = entry.annotation if len(entry_names(entry.name)) == 1 and entry.annotation else None
                if annotation is None and parameter is not None:
                    annotation = parameter.annotation
                if parameter is None:
                    logger.warning("%s: the docstring's Args name %r, which is not a parameter", obj.path, name)
                elif annotation is None:
                    logger.warning("%s: parameter %r has no type annotation for the API reference", obj.path, name)
                rows.append(griffe.DocstringParameter(name=name, description=entry.description,
                                                      annotation=annotation,
                                                      value=parameter.default if parameter is not None else None))
        section.value = rows
