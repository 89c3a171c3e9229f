"""The API reference (docs/api/, rendered by mkdocstrings from the docstrings) documents
every public name, and the docstrings say what the site's renderer can read: each entry
of an Args section names parameters the call has, each entry of a Raises section names
an exception. `mkdocs build --strict` (CI) renders the pages; these checks need no docs
dependencies, so a new public name without a page fails with the rest of the tests.

An Args entry may name several parameters that share a description ("src, dst: ..."):
the site's griffe extension (mkdocs_hooks.SharedParameters) renders each name in a row of
its own, with the type of its annotation, so each name an entry lists must be annotated.
The build warns, failing `--strict`, about a rendered parameter without a type."""

import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import zarrckpt

API_PAGES = sorted((Path(__file__).parent.parent / "docs" / "api").glob("*.md"))
# `::: zarrckpt.name`, mkdocstrings' directive, optionally followed by its options
# (`members: [a, b]`: names documented under that object's heading).
DIRECTIVE = re.compile(r"^::: zarrckpt\.(\w+)\s*$((?:\n[ \t]+.*)*)", re.M)
MEMBERS = re.compile(r"^\s+members:\s*\[([^\]]*)\]", re.M)
# An entry of a Google-style section: one or more names, then a colon. An Args entry may
# name several parameters that share a description ("src, dst: ...").
ARGS_ENTRY = re.compile(r"\**\w+(?:, \**\w+)*(?: \([^)]*\))?: ")
RAISES_ENTRY = re.compile(r"[\w.]+(?:, [\w.]+)*: ")


def documented() -> dict[str, str]:
    """Each name the API pages render, with the page that renders it."""
    found = {}
    for page in API_PAGES:
        for match in DIRECTIVE.finditer(page.read_text()):
            found[match.group(1)] = page.name
            for members in MEMBERS.findall(match.group(2)):
                found |= {name.strip().strip("'\""): page.name for name in members.split(",") if name.strip()}
    return found


def test_every_public_name_has_a_page() -> None:
    names = documented()
    assert len(names) > 20  # the pattern still finds the directives
    missing = sorted(set(zarrckpt.__all__) - set(names))
    assert not missing, f"public names missing from docs/api/*.md (add `::: zarrckpt.NAME` to a page): {missing}"


def test_every_page_names_public_names() -> None:
    stale = {name: page for name, page in documented().items() if name not in zarrckpt.__all__}
    assert not stale, f"docs/api/ renders names that are not in zarrckpt.__all__: {stale}"


def section(docstring: str, title: str) -> Iterator[str]:
    """The entry lines of section `title` of a Google-style docstring: the lines indented
    one step below the title (continuation lines, indented further, are skipped)."""
    lines = docstring.splitlines()
    for at, line in enumerate(lines):
        if line.strip() != f"{title}:":
            continue
        outer = len(line) - len(line.lstrip())
        body = [text for text in _until_dedent(lines[at + 1:], outer) if text.strip()]
        if body:
            indent = min(len(text) - len(text.lstrip()) for text in body)
            yield from (text.strip() for text in body if len(text) - len(text.lstrip()) == indent)


def _until_dedent(lines: list[str], outer: int) -> Iterator[str]:
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= outer:
            return
        yield line


def rendered() -> Iterator[tuple[str, Callable[..., object], Callable[..., object]]]:
    """(name, the object whose docstring is rendered, the callable whose parameters it
    documents) for every public name and every public method of a public class."""
    for name in zarrckpt.__all__:
        value = getattr(zarrckpt, name)
        if inspect.isclass(value):
            yield name, value, value.__init__
            for member, attribute in vars(value).items():
                function = attribute.fget if isinstance(attribute, property) else attribute
                if not member.startswith("_") and inspect.isfunction(function):
                    yield f"{name}.{member}", function, function
        elif callable(value):
            yield name, value, value


RENDERED = {name: (documented_object, function) for name, documented_object, function in rendered()}


@pytest.mark.parametrize("name", list(RENDERED))
def test_docstring_sections_are_readable(name: str) -> None:
    documented_object, function = RENDERED[name]
    docstring = inspect.getdoc(documented_object) or ""
    try:
        signature = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin's __init__
        signature = {}
    unreadable, unknown, untyped = [], [], []
    for entry in section(docstring, "Args"):
        match = ARGS_ENTRY.match(entry)
        if not match:
            unreadable.append(entry)
            continue
        names = [arg.lstrip("*") for arg in match.group(0).split(" (")[0].rstrip(": ").split(", ")]
        unknown += [arg for arg in names if arg not in signature]
        typed_in_entry = " (" in match.group(0) and len(names) == 1
        untyped += [arg for arg in names if arg in signature and not typed_in_entry
                    and signature[arg].annotation is inspect.Parameter.empty]
    unreadable += [entry for entry in section(docstring, "Raises") if not RAISES_ENTRY.match(entry)]
    assert not unreadable, f"{name}: entries the API reference cannot read (write `name: description`, the names " \
                           f"on the entry's first line): {unreadable}"
    assert not unknown, f"{name}: Args names that are not parameters of {name}: {unknown}"
    assert not untyped, f"{name}: parameters the API reference would show without a type (annotate them): {untyped}"


def test_the_site_gives_each_name_of_a_shared_args_entry_its_own_row() -> None:
    config = (Path(__file__).parent.parent / "mkdocs.yml").read_text()
    assert "- mkdocs_hooks.py:SharedParameters" in config
    assert "class SharedParameters(" in (Path(__file__).parent.parent / "mkdocs_hooks.py").read_text()
