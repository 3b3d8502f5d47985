"""Two "nodes" on one machine (``tests/helpers/netns.py``): a rate-limited veth pair between two
network namespaces, and a TP=2 ``generate`` with one rank in each — the multi-node case, where
the store and gloo listen on the first node's veth address instead of loopback. Jobs of four
ranks over the two namespaces (hierarchical TP, PP across nodes) run under Slurm
(tests/launch/test_slurm_two_nodes.py).

Skipped, with the reason, without root or the ``ip``/``tc`` tools.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import netns

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PROMPT = "It is a truth universally acknowledged"
PORT = 29517

_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""
_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); data = bytes(1 << 20); n = int(sys.argv[3])
t = time.perf_counter()
for _ in range(n): c.sendall(data)
c.shutdown(socket.SHUT_WR); got = int(c.recv(64)); print(got, time.perf_counter() - t)
"""


def _throughput_gbit(nodes: netns.TwoNodes, mib: int) -> float:
    """Bits per second from namespace a to b over TCP (``mib`` MiB, counted by the receiver)."""
    server = nodes.popen(1, [sys.executable, "-c", _SERVER, nodes.addr[1], str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    out = nodes.run(0, [sys.executable, "-c", _CLIENT, nodes.addr[1], str(PORT), str(mib)],
                    capture_output=True, text=True, check=True, timeout=60).stdout.split()
    server.wait(timeout=30)
    got, seconds = int(out[0]), float(out[1])
    assert got == mib << 20
    return got * 8 / seconds / 1e9


def test_the_veth_pair_is_rate_limited_and_removed_afterwards() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"dm{gone.pid}-0a0a"  # as if made by a test process killed before its clean-up
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with netns.two_nodes("1gbit") as nodes:
        names = nodes.ns
        for node in (0, 1):
            assert "tbf" in nodes.rate(node) and "rate 1Gbit" in nodes.rate(node)
        limited = _throughput_gbit(nodes, 48)
        nodes.set_rate(None)
        assert "tbf" not in nodes.rate(0)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names), "the namespaces (and with them the veth pair) must be gone"
    assert stale not in listed, "a killed run's namespaces are removed by the next run"
    assert 0.3 < limited < 1.1, f"1 Gbit/s limit measured {limited:.2f} Gbit/s"


def _model_and_hf_tokens(tmp_path):
    """The tiny full-rank decomposed folder, ``PROMPT``'s ids, and Hugging Face's 6 greedy tokens."""
    import torch
    import transformers

    from tests.helpers.tiny_models import full_rank_folders

    hf, _, model = full_rank_folders(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
    return model, ids, expected


def test_tp2_across_two_namespaces_gives_the_hugging_face_tokens(tmp_path) -> None:
    model, ids, expected = _model_and_hf_tokens(tmp_path)
    with netns.two_nodes("1gbit") as nodes:
        procs = []
        for node in (0, 1):  # what a launcher sets on each node: rank 0 on node a is the master
            env = nodes.launcher_env(node, PORT)
            procs.append(nodes.popen(node, [sys.executable, "-m", "deinfer_megatron.cli.main", "generate",
                                            "--model", str(model), "--tp", "2", "--layout", "deinfer",
                                            "--kv-cache", "latent", "--max-new-tokens", "6", "--prompt", PROMPT,
                                            "--json"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        started = time.monotonic()
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    doc = json.loads(outs[0][0])
    assert outs[1][0].strip() == "", "only rank 0 reports"
    assert doc["tp"] == 2 and doc["collectives"] == "gather-sum"  # no local peer: all-reduce as gather + sum across the link
    assert doc["outputs"][0]["token_ids"] == expected
    print(f"cross-namespace TP=2 generate: {time.monotonic() - started:.1f} s")


def test_auto_across_namespaces_prices_the_jobs_own_link(tmp_path) -> None:
    """``--layout auto`` with one rank per namespace at 1 Gbit/s: the planted table says the local
    collectives are free (so naive MLPs, the fewest bytes per rank, would win), but rank 0 prices
    the plan with the TP group's collectives measured in the job, over the link — the plan the
    formula gives with those rates, without naive MLPs, and the Hugging Face tokens."""
    from dataclasses import replace

    from deinfer_megatron.checkpoints.folder import open_config
    from deinfer_megatron.planning import cost_model
    from deinfer_megatron.planning.pricing import Workload, choose_layouts, required_gemms
    from tests.helpers.cost_tables import FREE, _gemm, free_attention

    model, ids, expected = _model_and_hf_tokens(tmp_path)
    arch, ranks = open_config(model, verify=False)
    blocks = {l: {b: (1.0 if l == "dense" else 0.0) for b in ("attention", "mlp")} for l in ("deinfer", "naive", "dense")}
    work = Workload(tp=2, batch=1, context=ids.shape[1] + 6)
    shapes = {cost_model.shape_key("float32", g): [[float(m), 1e-10 * m * g.weights]]  # weights at a fixed rate
              for g, m in required_gemms(arch, ranks, work)}
    table = cost_model.CostTable(cost_model.TableKey.current(1), _gemm(FREE), FREE,
                                 {"all_reduce": [0.0, FREE], "all_gather": [0.0, FREE]},
                                 {"2": {"blocks": blocks, "layer": 0.0, "outside": 0.0}}, shapes,  # dense out of the race
                                 free_attention(arch, ranks, work))
    cost_model.save(table, cost_model.cache_path(table.key, tmp_path / "cache0" / "cost_model"))
    local = choose_layouts(arch, ranks, work, table).plan
    assert {b.mlp.value for b in local.layers} == {"naive"}, "free local collectives must favour naive MLPs"
    with netns.two_nodes("1gbit") as nodes:
        procs = []
        for node in (0, 1):
            env = nodes.launcher_env(node, PORT + 1, DEINFER_MEGATRON_CACHE=str(tmp_path / f"cache{node}"))
            procs.append(nodes.popen(node, [sys.executable, "-m", "deinfer_megatron.cli.main", "generate",
                                            "--model", str(model), "--tp", "2", "--layout", "auto",
                                            "--max-new-tokens", "6", "--prompt", PROMPT, "--json"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    doc = json.loads(outs[0][0])
    link = doc["auto_collectives"]
    # the link's rates, not the planted free ones: the large all-reduce (128 Ki floats, 512 KiB
    # sent by each rank) passes its first 256 KiB in the tbf burst at most and the rest at
    # 125 MB/s. Not the fitted bandwidth alone: the line through two noisy medians can put it
    # above 1 Gbit/s (1.74 GB/s once, beside a 2.8 ms latency) while the times are the link's.
    from deinfer_megatron.runtime.agree import SIZES

    latency, bandwidth = link["all_reduce"]
    assert latency > 0 and latency + 4 * SIZES[1] / bandwidth >= (4 * SIZES[1] - 256 * 1024) / 125e6, link
    priced = choose_layouts(arch, ranks, work, replace(table, collectives=link))
    assert doc["block_layouts"] == priced.plan.to_json()
    for i, layer in enumerate(priced.seconds):  # where the measured link makes DeInfer cheaper, no naive MLP
        if layer["mlp"]["deinfer"] < layer["mlp"]["naive"]:
            assert doc["block_layouts"][i]["mlp"] != "naive", (i, layer["mlp"])
    # the link is priced (a naive MLP costs at least one measured all-reduce latency), not the free local table
    assert all(layer["mlp"]["naive"] >= link["all_reduce"][0] for layer in priced.seconds)
    assert doc["outputs"][0]["token_ids"] == expected
    assert not (tmp_path / "cache1").exists(), "rank 1 prices no plan of its own"
    print(f"auto across namespaces at 1 Gbit/s: measured {link}; plan {doc['block_layouts']}")
