"""Install the wheelhouse (bench/gpu/wheelhouse/) for run_all.sh on a machine without internet, whatever its Python
lacks. Standard library only.

    python bench/gpu/install_wheelhouse.py --wheels DIR --requirements FILE --target DIR [--method auto|venv|pip|unpack]

Prints, as its last line, how to run with the packages: ``PYTHON=<interpreter>`` (a virtualenv that sees the
system's packages: torch stays the machine's CUDA build) or ``PYTHONPATH=<directory>`` (prepend it).

Methods, tried in this order by ``auto``:

* ``venv``: ``python -m venv --system-site-packages``, then a check that the system's torch is the one
  the virtualenv imports (``import torch; torch.cuda.is_available()`` run there gives this interpreter's
  version and answer; it does not where this interpreter is itself a virtualenv, whose
  ``--system-site-packages`` child sees the base installation's packages instead), then pip inside it.
  A failed check removes the virtualenv and says why in one line, and ``auto`` goes on to the next method.
  Pip needs ``ensurepip``, which some distributions ship separately (Debian's ``python3-venv``);
* ``pip``: the system's pip installs into ``--target`` (``pip install --target``);
* ``unpack``: no pip at all. A wheel is a zip archive laid out as its installed files, so each required
  wheel is extracted into ``--target`` (``<name>.data/purelib`` and ``platlib`` moved to the top, as pip does);
  console scripts are not created (run_all.sh runs ``python -m pytest``).

Every requirement (``name==version`` lines of ``--requirements``) must have a wheel in ``--wheels``: otherwise
one line names the missing one and the exit status is 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: Path) -> list:
    """``[(name, version)]`` of the pinned lines of a requirements file (comments and blanks skipped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out.append((name.strip(), version.strip()))
    return out


def _compatible(filename: str) -> int:
    """Preference of a wheel for this interpreter: 2 its CPython tag, 1 pure Python or abi3, 0 other."""
    tags = filename[: -len(".whl")].split("-")[-3:]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if tags[0] == here:
        return 2
    return 1 if tags[0].startswith("py3") or tags[1] == "abi3" else 0


def find_wheels(wheels: Path, reqs: list) -> list:
    """The wheel file of every requirement; SystemExit(2) with one line for the first one missing."""
    found = []
    files = sorted(p for p in wheels.glob("*.whl"))
    for name, version in reqs:
        matches = [
            p
            for p in files
            if _norm(p.name.split("-")[0]) == _norm(name) and (not version or p.name.split("-")[1] == version)
        ]
        matches = [p for p in matches if _compatible(p.name)]
        if not matches:
            sys.stderr.write(
                f"install_wheelhouse.py: {name}=={version} has no wheel for this Python in {wheels} "
                f"(build it with bench/gpu/build_wheelhouse.sh)\n"
            )
            raise SystemExit(2)
        found.append(max(matches, key=lambda p: _compatible(p.name)))
    return found


def unpack(wheel_files: list, target: Path) -> None:
    """Extract each wheel into ``target`` (what pip does with a wheel, minus scripts and its record)."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheel_files:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                parts = member.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed to import
                    relative = "/".join(parts[2:])
                else:
                    relative = member
                if not relative or relative.endswith("/"):
                    continue
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(destination, "wb") as dst:
                    shutil.copyfileobj(src, dst)


def _run(cmd: list) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


#: how the virtualenv is made: it must see the system's packages (torch, the machine's CUDA build)
VENV_OPTIONS = ["--system-site-packages"]
#: what the proof needs of torch in the environment it runs in
TORCH_PROBE = "import torch; print(torch.__version__, torch.cuda.is_available())"


def _torch_probe(python) -> tuple:
    """``(True, "<version> <cuda available>")`` from ``python``, or ``(False, the error's last line)``."""
    proc = subprocess.run([str(python), "-c", TORCH_PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return False, lines[-1]
    return True, proc.stdout.strip()


def venv_torch_problem(python) -> str | None:
    """Why the virtualenv's ``python`` cannot run the proof with this interpreter's torch, or None."""
    ok, there = _torch_probe(python)
    if not ok:
        return f"import torch fails there ({there})"
    ok, here = _torch_probe(sys.executable)
    if ok and here != there:
        return f"torch, CUDA available: {there} there, {here} for {sys.executable}"
    return None


def install(wheels: Path, reqs_file: Path, target: Path, method: str) -> str:
    reqs = requirements(reqs_file)
    wheel_files = find_wheels(wheels, reqs)
    pip_args = ["install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps", *[str(p) for p in wheel_files]]
    if method in ("auto", "venv"):
        venv = target / "venv"
        python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
        problem = None
        if _run([sys.executable, "-m", "venv", *VENV_OPTIONS, "--without-pip", str(venv)]):
            problem = venv_torch_problem(python)
            if problem is None and _run([str(python), "-m", "ensurepip", "--default-pip"]):
                if _run([str(python), "-m", "pip", *pip_args]):
                    return f"PYTHON={python}"
        if problem is not None:
            shutil.rmtree(venv, ignore_errors=True)
            why = f"the virtualenv {venv} does not see this interpreter's torch: {problem}"
            if method == "venv":
                raise SystemExit(f"install_wheelhouse.py: {why}")
            sys.stderr.write(f"install_wheelhouse.py: {why}; installing into a directory on PYTHONPATH instead\n")
        elif method == "venv":
            raise SystemExit(
                "install_wheelhouse.py: python -m venv with pip failed (no ensurepip?): use --method pip or unpack"
            )
    site = target / "site"
    if method in ("auto", "pip") and _run([sys.executable, "-m", "pip", *pip_args, "--target", str(site)]):
        return f"PYTHONPATH={site}"
    if method == "pip":
        raise SystemExit("install_wheelhouse.py: pip install --target failed (no pip?): use --method unpack")
    directory = site if method == "auto" else target
    unpack(wheel_files, directory)
    return f"PYTHONPATH={directory}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", required=True, type=Path)
    ap.add_argument("--requirements", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path, help="where the environment goes")
    ap.add_argument("--method", default="auto", choices=("auto", "venv", "pip", "unpack"))
    args = ap.parse_args(argv)
    print(install(args.wheels, args.requirements, args.target, args.method))
    return 0


if __name__ == "__main__":
    sys.exit(main())
