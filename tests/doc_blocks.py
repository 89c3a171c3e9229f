"""The code blocks of README.md and docs/**/*.md, as the tests run them.

A ```python or ```bash block runs as written, in a fresh empty directory, in an interpreter
of its own, unless the paragraph right before it says one of these (case does not matter):

- "continues the block above": it runs after the page's block before it, in the same
  interpreter and directory (a chain of blocks, which may mix Python and bash);
- "needs an S3 bucket": its chain runs against the test suite's own S3 server, reached as
  a user reaches one, through `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID` and
  `AWS_SECRET_ACCESS_KEY`, with the bucket `my-bucket` made there;
- "not run by the tests": it is not run (the paragraph says why).

Lines of a bash block that start with `pip install` are not run: they name the packages
the block needs, which the `test` extra installs. Blocks of any other fence (```text for
output listings, ```json) never run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = ("python", "bash")
CONTINUES = "continues the block above"
NEEDS_S3 = "needs an s3 bucket"
NOT_RUN = "not run by the tests"
S3_BUCKET = "my-bucket"
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its code, and the paragraph right before it."""

    page: str
    line: int
    language: str
    code: str
    before: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def says(self, words: str) -> bool:
        return words in " ".join(self.before.lower().split())


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order."""
    text = page.read_text()
    found, end = [], 0
    for match in _FENCE.finditer(text):
        paragraphs = [p for p in re.split(r"\n\s*\n", text[end:match.start()]) if p.strip()]
        found.append(Block(page_name(page), text.count("\n", 0, match.start()) + 1, match.group(1),
                           match.group(2), paragraphs[-1] if paragraphs else ""))
        end = match.end()
    return found


def chains(page: Path) -> list[list[Block]]:
    """The runnable blocks of `page`, grouped into the chains that run in one interpreter each."""
    grouped: list[list[Block]] = []
    for block in blocks(page):
        if block.language not in RUNNABLE or block.says(NOT_RUN):
            continue
        if block.says(CONTINUES):
            assert grouped, f"{block.name} says it continues the block above, but no runnable block is above it"
            grouped[-1].append(block)
        else:
            grouped.append([block])
    return grouped


def all_chains() -> list[list[Block]]:
    return [chain for page in PAGES for chain in chains(page)]


_DRIVER = """
import json, subprocess, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    print(f"== {block['name']}", flush=True)
    if block["language"] == "python":
        exec(compile(block["code"], block["name"], "exec"), namespace)
    else:
        code = "\\n".join(line for line in block["code"].splitlines() if not line.lstrip().startswith("pip install"))
        subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True)
"""


def run_chain(chain: list[Block], directory: Path, env: dict[str, str] | None = None,
              timeout: float = 600) -> str:
    """Runs `chain` in `directory` in one interpreter of this test's Python, with this
    checkout's zarrckpt and its `zarrckpt` command first; returns its output, or fails
    the test with it."""
    script = directory.parent / f"{directory.name}-blocks.json"
    script.write_text(json.dumps([{**dataclasses.asdict(b), "name": b.name} for b in chain]))
    environment = {**os.environ, **(env or {})}
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [environment.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(script)], cwd=directory, env=environment,
                          capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the blocks {[b.name for b in chain]} failed:\n{output[-6000:]}"
    return output
