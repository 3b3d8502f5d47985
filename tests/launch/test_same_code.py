"""``--launcher torchrun|deepspeed``: the ranks run the code of the command that started them.

A command run from a copy of the package (a worktree, a checkout beside an editable install)
starts a launcher whose ranks would otherwise import whatever their own ``sys.path`` finds first:
DeepSpeed's ranks run the environment's ``deinfer-megatron`` script (the installed package),
torchrun's ``python -m`` the package in the working directory. Here the command imports a copy
(``copy/``) while the working directory holds another (``decoy/``) and the environment's install
points at a third; every process that imported ``deinfer_megatron`` records where it came from
(a ``sitecustomize`` on ``PYTHONPATH``, outside the package), and all of them must name the copy.

The same launches are the check that both launchers give Hugging Face's greedy tokens (DeepSpeed's
with ``--engine deepspeed``, as a DeepSpeed user runs it): one launch per launcher carries both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deinfer_megatron
from tests.helpers.tiny_models import full_rank_folders, hf_greedy_texts

RECORDER = '''
import atexit, os, sys

def _record():
    module = sys.modules.get("deinfer_megatron")
    if module is not None:
        with open(os.path.join(os.environ["RECORD_IMPORTS"], str(os.getpid())), "w") as f:
            f.write(module.__file__)

atexit.register(_record)
'''
PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever"]
NEW_TOKENS = 6
# The command itself: the copy first on sys.path, the working directory (the decoy) right after.
START = "import sys; sys.path.insert(0, sys.argv.pop(1)); from deinfer_megatron.cli.main import run; sys.exit(run())"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("same-code")
    hf, _, dec = full_rank_folders(root / "model")
    expected = hf_greedy_texts(hf, dec, PROMPTS, NEW_TOKENS)
    package = Path(deinfer_megatron.__file__).parent
    for name in ("copy", "decoy"):
        shutil.copytree(package, root / name / "deinfer_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(RECORDER)
    return {"root": root, "model": dec, "expected": expected}


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_launched_ranks_run_the_commands_package_and_give_the_same_tokens(tree, tmp_path: Path, launcher: str) -> None:
    root, records = tree["root"], tmp_path / "imports"
    records.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(PYTHONPATH=str(root / "site"), RECORD_IMPORTS=str(records), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", START, str(root / "copy"), "generate", "--model", str(tree["model"]),
           "--tp", "2", "--layout", "deinfer", "--launcher", launcher, "--max-new-tokens", str(NEW_TOKENS), "--json"]
    cmd += [arg for p in PROMPTS for arg in ("--prompt", p)]
    cmd += ["--engine", "deepspeed"] if launcher == "deepspeed" else []
    proc = subprocess.run(cmd, cwd=root / "decoy", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # stdout is the one JSON document, the launcher's logs go to stderr
    assert doc["tp"] == 2
    assert [o["token_ids"] for o in doc["outputs"]] == tree["expected"]
    imported = {int(p.name): Path(p.read_text()) for p in records.iterdir()}
    assert len(imported) >= 3, f"the command and its 2 ranks should have recorded, got {imported}"
    elsewhere = {pid: str(f) for pid, f in imported.items() if root / "copy" not in f.parents}
    assert not elsewhere, f"processes ran another deinfer_megatron than the command's copy: {elsewhere}"
