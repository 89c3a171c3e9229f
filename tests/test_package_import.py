"""`import zarrckpt` and `zarrckpt --version` import no JAX: the public names come from
their modules at first use (PEP 562), and the command parses its command line before it
imports the library. The import still makes zarr know zarrckpt's data types."""

import subprocess
import sys
import textwrap
from pathlib import Path

import zarrckpt

ROOT = Path(__file__).resolve().parent.parent


def fresh(code: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a new interpreter that has imported nothing of the tests'."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_import_zarrckpt_imports_no_jax_and_registers_the_dtypes():
    done = fresh("""
        import sys
        import zarrckpt
        from zarr.dtype import data_type_registry
        assert "jax" not in sys.modules, "import zarrckpt imported jax"
        # contents, not a lookup: a lookup would load zarrckpt's entry points of an install
        print(data_type_registry.contents["bfloat16"].__name__)
        print(zarrckpt.__version__)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["BFloat16", zarrckpt.__version__]


def test_version_imports_no_jax():
    done = fresh("""
        import sys
        from zarrckpt._cli import main
        try:
            main(["--version"])
        except SystemExit as e:
            assert e.code == 0, e.code
        else:
            raise AssertionError("--version did not exit")
        assert "jax" not in sys.modules, "zarrckpt --version imported jax"
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"zarrckpt {zarrckpt.__version__}\n"


def test_every_public_name_resolves_and_is_listed():
    done = fresh("""
        import sys
        import zarrckpt
        assert set(zarrckpt.__all__) <= set(dir(zarrckpt)), set(zarrckpt.__all__) - set(dir(zarrckpt))
        assert "jax" not in sys.modules
        namespace = {}
        exec(f"from zarrckpt import {', '.join(zarrckpt.__all__)}", namespace)
        exec("from zarrckpt import *", namespace)
        assert all(namespace[name] is getattr(zarrckpt, name) for name in zarrckpt.__all__)
        try:
            zarrckpt.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("a missing name resolved")
    """)
    assert done.returncode == 0, done.stderr
    assert set(zarrckpt._MODULE_OF) == set(zarrckpt.__all__)
    assert zarrckpt.load_pytree.__module__.startswith("zarrckpt._restore")
