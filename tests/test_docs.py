"""What the README and docs/ cite exists (every test, test file, benchmark, example and
document they name in backticks, every page they link to), and every code block of
theirs runs as written (tests/doc_blocks.py says how blocks are run)."""

import ast
import re
import sys
from pathlib import Path

import pytest
from doc_blocks import NEEDS_S3, PAGES, S3_BUCKET, all_chains, blocks, page_name, run_chain

ROOT = Path(__file__).parent.parent
DOCUMENTS = PAGES
TEST_FILES = sorted((ROOT / "tests").rglob("test_*.py"))
DEFINED = {name for file in TEST_FILES for name in re.findall(r"^def (test_\w+)\(", file.read_text(), re.M)}


def cited(pattern: str) -> list[tuple[str, re.Match]]:
    return [(document.name, match) for document in DOCUMENTS for match in re.finditer(pattern, document.read_text())]


@pytest.mark.parametrize("document", [page_name(d) for d in DOCUMENTS])
def test_every_cited_test_exists(document: str) -> None:
    text = (ROOT / document).read_text()
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


def test_every_relative_link_resolves_to_a_file() -> None:
    """Links between pages are relative paths to files, as GitHub and the site both resolve them."""
    broken = []
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (document.parent / path).exists():
                broken.append(f"{page_name(document)}: {target}")
    assert not broken, f"links to nothing: {broken}"


# Modules a Python block may import without naming their package: the standard library,
# zarrckpt and what it depends on.
_NEEDS_NO_NAMING = set(sys.stdlib_module_names) | {"jax", "numpy", "zarrckpt", "zarr", "fsspec"}
_PACKAGES = {"safetensors": "safetensors", "grain": "grain", "optax": "optax", "s3fs": "s3fs", "flax": "flax",
             "equinox": "equinox", "orbax": "orbax-checkpoint", "gcsfs": "gcsfs"}


@pytest.mark.parametrize("page", [page_name(p) for p in PAGES])
def test_every_python_block_names_the_packages_it_needs(page: str) -> None:
    """The paragraph right before a block, or one it continues, names what it imports beyond
    zarrckpt and its dependencies, so a reader knows what to install."""
    unnamed, named = [], ""
    for block in blocks(ROOT / page):
        if block.language != "python":
            continue
        named = (named if "continues the block above" in " ".join(block.before.lower().split()) else "") \
            + block.before
        imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(block.code))
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(block.code))
                     if isinstance(node, ast.ImportFrom) and node.module}
        for module in sorted(imported - _NEEDS_NO_NAMING):
            if _PACKAGES.get(module, module) not in named:
                unnamed.append(f"{block.name} imports {module}")
    assert not unnamed, f"blocks that do not name the package they need: {unnamed}"


CHAINS = all_chains()


@pytest.mark.parametrize("chain", CHAINS, ids=[chain[0].name for chain in CHAINS])
def test_every_code_block_runs_as_written(chain, tmp_path, request) -> None:
    env = {}
    if any(block.says(NEEDS_S3) for block in chain):
        server = request.getfixturevalue("s3_server")
        import s3fs

        filesystem = s3fs.S3FileSystem(**server.options())
        if not filesystem.exists(S3_BUCKET):
            filesystem.mkdir(S3_BUCKET)
        env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": server.options()["key"],
               "AWS_SECRET_ACCESS_KEY": server.options()["secret"]}
    directory = tmp_path / "work"
    directory.mkdir()
    run_chain(chain, directory, env)


def test_the_pages_have_runnable_blocks() -> None:
    """The runner finds the blocks (a change of fence or marker would otherwise skip them all)."""
    assert sum(len(chain) for chain in CHAINS) >= 20
