"""``generate.sbatch`` on a real two-node Slurm cluster: slurmd in each of two network
namespaces joined by a 1 Gbit/s veth pair (``tests/helpers/slurm/two_nodes.py``), checked
against Hugging Face greedy tokens:

- TP across the nodes: TP=4 with two ranks per node — the hierarchical collectives (shared
  memory inside a node, gloo across);
- TP inside a node, PP across: TP=2 × PP=2, each TP group on one node (shared memory).

Skipped, with the reason, without root, ip/tc, Slurm or munge.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.slurm.two_nodes import skip_reason, two_node_cluster

PROMPT = "It is a truth universally acknowledged"
REASON = skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def model_and_tokens(tmp_path_factory):
    import torch
    import transformers

    from tests.helpers.tiny_models import full_rank_folders

    hf, _, model = full_rank_folders(tmp_path_factory.mktemp("two-nodes"))
    ids = transformers.AutoTokenizer.from_pretrained(model)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
    return model, expected


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster("1gbit") as c:
        yield c


@pytest.mark.parametrize("tp, pp, collectives", [(4, 1, "hierarchical"), (2, 2, "shared-memory")],
                         ids=["tp-across-nodes", "pp-across-nodes"])
def test_generate_sbatch_spans_both_nodes(cluster, model_and_tokens, tp: int, pp: int, collectives: str) -> None:
    model, expected = model_and_tokens
    rc, out = cluster.sbatch("scripts/slurm/generate.sbatch", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                             timeout=300, script_args=("--model", str(model), "--tp", str(tp), "--pp", str(pp),
                                                       "--layout", "deinfer", "--max-new-tokens", "6",
                                                       "--prompt", PROMPT, "--json"))
    assert rc == 0, f"generate.sbatch exited {rc}; output:\n{out}"
    docs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(docs) == 1, f"exactly rank 0 reports; output:\n{out}"
    assert (docs[0]["tp"], docs[0]["pp"], docs[0]["collectives"]) == (tp, pp, collectives)
    assert docs[0]["outputs"][0]["token_ids"] == expected
