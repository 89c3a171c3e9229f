"""README.md stays short, its first Python block runs alone in an empty directory, and
the blocks that need no object store run in order in one interpreter (tests/test_docs.py
runs every block of README.md and docs/; tests/doc_blocks.py says how)."""

from pathlib import Path

from doc_blocks import NEEDS_S3, ROOT, blocks, chains, run_chain

README = ROOT / "README.md"


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_the_first_python_block_runs_alone_in_an_empty_directory(tmp_path: Path) -> None:
    first = next(block for block in blocks(README) if block.language == "python")
    assert "logging.basicConfig(level=logging.INFO)" in first.code  # batch jobs see progress only so
    directory = tmp_path / "empty"
    directory.mkdir()
    output = run_chain([first], directory)
    assert "[50, 100]" in output


def test_the_blocks_without_an_object_store_are_one_chain() -> None:
    """Every block that needs no bucket continues the Quickstart, so they run in one interpreter."""
    local = [chain for chain in chains(README) if not any(block.says(NEEDS_S3) for block in chain)]
    assert len(local) == 2 and local[0][0].language == "bash", [[b.name for b in chain] for chain in local]
    assert len(local[1]) >= 3 and local[1][0].language == "python"


def test_the_commands_ci_and_the_developers_guide_rely_on_are_there() -> None:
    text = README.read_text()
    assert ('python3 -m venv .venv && .venv/bin/pip install -q ".[test]" && '
            '.venv/bin/python -m pytest -q -n 3 --dist worksteal') in text
    assert "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/python examples/train_minimal.py" in text
