"""Every Python block of README.md runs as written, in order, in one namespace that holds
only what earlier blocks defined (no stand-ins: the quickstart defines its own tiny
model), with a temporary directory for its URLs."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_every_python_block_of_the_readme_runs(tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 5, "the README lost its examples"
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        code = (block.replace("gs://bucket/", f"{tmp_path}/").replace("/tmp/ckpt", f"{tmp_path}/ckpt")
                .replace("timeout_s=600", "timeout_s=0.2"))
        exec(compile(code, f"README.md python block {number}", "exec"), namespace)
    import zarrckpt

    assert zarrckpt.all_steps(f"{tmp_path}/run1") == [1000, 1001]  # the quickstart saved, then the functions
    assert namespace["restored"]["data"].value == {"next_index": 0}  # a fresh grain iterator's position
    assert namespace["evaluated"]["params"]["w"].shape == (4, 1)
