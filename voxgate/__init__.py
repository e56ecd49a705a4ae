"""Voxgate: a real-time WebRTC voice gateway.

The product's folders sit at the top of the repository (signaling/, gateway/,
engine/, web/) and install as voxgate.signaling, voxgate.gateway, ... through
pyproject.toml's package-dir mapping. From a clone that is not installed, this
folder alone would import as `voxgate` and fail later with an import error that
does not say why; so the mapping is checked here, once, and the error says what
to do.
"""

from importlib.util import find_spec
from pathlib import Path

INSTALL_HINT = "run `pip install -e .` in the clone (or `pip install .`), then `voxgate ...` or `python -m voxgate ...`"


def _check_installed() -> None:
    here = Path(__file__).resolve().parent
    spec = find_spec(__name__ + ".signaling")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    # Installed: site-packages/voxgate/signaling. Editable: <clone>/signaling beside <clone>/voxgate.
    if found in (here / "signaling", here.parent / "signaling"):
        return
    where = "is not installed" if found is None else f"is not the installed one (that is {found.parent})"
    raise ImportError(f"voxgate: the package at {here.parent} {where}: {INSTALL_HINT}")


_check_installed()
