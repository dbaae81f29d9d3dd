"""The npm package as a host gets it: the built client is part of the repository (a folder
install runs no build, as npm installs no devDependencies of a folder), so it must be the
build of the sources, and a folder install must give a client that runs a worker."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from worker.host import REPO_ROOT

DIST = REPO_ROOT / "client" / "dist" / "src"


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True)
    return [name for name in listed.stdout.decode().split("\0") if name]


def test_the_committed_client_build_is_the_build_of_its_sources():
    tsc = REPO_ROOT / "node_modules" / ".bin" / "tsc"
    assert tsc.exists(), "run `npm ci` (make test does) so that TypeScript is installed"
    # Built beside dist, at the same depth, so that the source maps' relative paths match.
    check = REPO_ROOT / "client" / ".build-check-test"
    shutil.rmtree(check, ignore_errors=True)
    try:
        subprocess.run([str(tsc), "-p", "client", "--outDir", str(check)], cwd=REPO_ROOT, check=True)
        built = {p.relative_to(check / "src"): p.read_bytes() for p in (check / "src").rglob("*") if p.is_file()}
        committed = {p.relative_to(DIST): p.read_bytes() for p in DIST.rglob("*") if p.is_file()}
    finally:
        shutil.rmtree(check, ignore_errors=True)
    stale = sorted(str(name) for name in built.keys() | committed.keys() if built.get(name) != committed.get(name))
    assert stale == [], f"client/dist/src differs from a build of client/src: {stale}; run `npm run build` and commit it"
    assert {f"client/dist/src/{name}" for name in map(str, committed)} <= set(tracked_files())


def test_a_folder_install_gives_a_client_that_runs_a_worker(tmp_path: Path):
    checkout, host = tmp_path / "checkout", tmp_path / "host"
    for name in tracked_files():  # a fresh clone: what git holds, no node_modules, no build
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, checkout / name)
    host.mkdir()
    (host / "package.json").write_text(json.dumps({"name": "host", "private": True, "type": "module"}))
    install = subprocess.run(
        ["npm", "install", "--offline", "--no-audit", "--no-fund", str(checkout)],
        cwd=host, capture_output=True, text=True, timeout=120,
    )
    assert install.returncode == 0, install.stderr
    script = """
import { LmWorker } from "lm-worker";
const worker = await LmWorker.start({ python: process.argv[1] });
await worker.load({ backend: "echo" });
const result = await worker.generate({ prompt: "folder", max_tokens: 20 }).result;
console.log(JSON.stringify({ text: result.text, finish: result.finish_reason }));
await worker.close();
"""
    ran = subprocess.run(
        ["node", "--input-type=module", "-e", script, sys.executable],
        cwd=host, capture_output=True, text=True, timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == {"text": "folder", "finish": "stop"}
