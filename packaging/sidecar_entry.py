"""Entry point of the frozen bundle (PyInstaller): the ``sidecar`` command.

PyInstaller's bootloader points ``LD_LIBRARY_PATH`` at the bundle's own libraries (libssl,
libz, libstdc++, ...) and sets ``_PYI_*`` variables. This process has loaded its libraries
by now (the dynamic loader reads the variable once, at exec), so they are taken out of
``os.environ`` here: the tool the sidecar spawns must get the environment its image was
built for, not the bundle's libraries.
"""

import os

from sidecar.cli import main


def restore_environment(env=os.environ) -> None:
    """Undo the bootloader's changes to the environment children inherit."""
    original = env.pop("LD_LIBRARY_PATH_ORIG", None)
    if original is not None:
        env["LD_LIBRARY_PATH"] = original
    else:
        env.pop("LD_LIBRARY_PATH", None)
    for name in [n for n in env if n.startswith("_PYI_") or n == "_MEIPASS2"]:
        del env[name]


if __name__ == "__main__":
    restore_environment()
    raise SystemExit(main())
