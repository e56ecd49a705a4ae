"""The one module that reaches inside PyAV's wheel: the folder its bundled libraries ship in.

gateway/media/opus.py calls libopus directly (through ctypes), and the libopus it prefers is the
one PyAV's wheels bundle: the same build aiortc's PyAV uses, present wherever the gateway
runs, with no system package. PyAV has no API that names it; its Linux wheels (auditwheel)
put it in the `av.libs` folder beside the `av` package, and its macOS wheels (delocate) in
`av/.dylibs`. That layout is the wheel's, not PyAV's API, so pyproject.toml pins PyAV with an
upper bound, the server checks at start which libopus it loaded (opus.library()) and says so
in its "fast paths:" line (`summary`), and tests/test_compat_homes.py fails where the pinned
wheel does not bundle one. Without it, opus.py falls back to the system's libopus.
"""

from __future__ import annotations

import glob
import os
from importlib import metadata

# Where auditwheel (Linux) and delocate (macOS) put a wheel's bundled libraries.
_LINUX_FOLDER = "av.libs"
_MACOS_FOLDER = ".dylibs"


def version() -> str:
    try:
        return metadata.version("av")
    except metadata.PackageNotFoundError:
        return "?"


def bundled(prefix: str) -> list[str]:
    """The libraries named `prefix`* that PyAV's wheel ships (none: PyAV built from source, or absent)."""
    try:
        import av
    except ImportError:
        return []
    package = os.path.dirname(av.__file__)
    found = sorted(glob.glob(os.path.join(os.path.dirname(package), _LINUX_FOLDER, prefix + "*.so*")))
    found += sorted(glob.glob(os.path.join(package, _MACOS_FOLDER, prefix + "*.dylib")))
    return found


def summary(path: str, library_version: str) -> str:
    """The start-up line's words for the libopus that opus.py loaded from `path`."""
    where = f"PyAV {version()}'s wheel" if path in bundled("libopus") else f"the system ({path}; PyAV's wheel has none)"
    return f"{library_version} from {where}"
