"""What the README and docs/ cite exists: every test, test file, benchmark, example and
document they name in backticks, so that a citation cannot go stale unnoticed (one
named a test file that had been split up)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEST_FILES = sorted((ROOT / "tests").rglob("test_*.py"))
DEFINED = {name for file in TEST_FILES for name in re.findall(r"^def (test_\w+)\(", file.read_text(), re.M)}


def cited(pattern: str) -> list[tuple[str, re.Match]]:
    return [(document.name, match) for document in DOCUMENTS for match in re.finditer(pattern, document.read_text())]


@pytest.mark.parametrize("document", [d.name for d in DOCUMENTS])
def test_every_cited_test_exists(document: str) -> None:
    text = (ROOT / ("README.md" if document == "README.md" else f"docs/{document}")).read_text()
    missing = []
    for match in re.finditer(r"`(?:(tests/[\w/]+\.py)::)?(test_\w+)(?:\[[^\]`]*\])?`", text):
        file, name = match.groups()
        defined = re.findall(r"^def (test_\w+)\(", (ROOT / file).read_text(), re.M) if file and (ROOT / file).exists() \
            else DEFINED
        if name not in defined:
            missing.append(match.group(0))
    assert not missing, f"{document} cites tests that do not exist: {missing}"


def test_every_cited_file_exists() -> None:
    names = {p.name for p in TEST_FILES}
    missing = [f"{document}: {match.group(1)}" for document, match in
               cited(r"`((?:tests|benchmarks|examples|docs|zarrckpt)/[\w/.-]+\.(?:py|md))")
               if not (ROOT / match.group(1)).exists()]
    missing += [f"{document}: {match.group(1)}" for document, match in cited(r"`(test_\w+\.py)`")
                if match.group(1) not in names]
    assert not missing, f"cited but not there: {missing}"
    assert len(cited(r"`(test_\w+)")) > 20  # the pattern still finds the citations
