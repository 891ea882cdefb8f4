"""Two nodes, as torchrun runs them: two agents meet at a c10d rendezvous endpoint (docs/ddp.md, several nodes).

Two torchrun agents on one machine are a faithful multi-node test: each is what one node runs, they share nothing
but the rendezvous endpoint and the output folder (a shared filesystem, as several nodes need). Under
`--rdzv-backend c10d` torchrun does not honour `--node-rank`: the agents get their ranks in the order they join,
so global rank 0, which alone writes the outputs, may run on either "node". The test starts the agent labelled
`--node-rank 1` first (so rank 0 usually lands there) and checks only what holds whatever the order: the job
trains the weights of the single-node 2-rank run, and the outputs come from the process whose RANK was 0.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid

import pytest
from conftest import DDP_TORCHRUN_FLAGS, REPO, TORCHRUN_AGENT, TORCHRUN_VARS, load_model_state, max_param_diff

# The single-node run is conftest's ddp_torchrun_uninterrupted (2 ranks on one node, one job per pytest run, read by
# tests/test_ddp_torchrun.py and tests/test_preemption.py too): the two nodes train with its flags (the mlp in 64-true,
# 2 epochs of digits at a global batch of 32), and the model is nothing this test is about.
FLAGS = DDP_TORCHRUN_FLAGS
TOL = 1e-9  # 64-true: the same ranks compute the same shards in the same order; only the launch differs
AGENT_TIMEOUT_S = 240  # the job takes ~10 s here; a rendezvous that never completes must end the test
JOIN_GAP_S = 2.0  # the "node 1" agent starts this long before "node 0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(node_rank: int, endpoint: str, rdzv_id: str, out_dir) -> subprocess.Popen:
    """One node's torchrun: one worker, c10d rendezvous at endpoint. LOGLEVEL=INFO makes the agent log the ranks
    the rendezvous gave it (`global_ranks=[...]`); OMP_NUM_THREADS=1 as torchrun sets it for --nproc_per_node 2."""
    cmd = [*TORCHRUN_AGENT, "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
           "--rdzv-conf", "join_timeout=120", str(REPO / "launch" / "ddp.py"), *FLAGS, "--out-dir", str(out_dir)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONUNBUFFERED="1", LOGLEVEL="INFO", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


@pytest.mark.slow
def test_two_nodes_train_the_single_node_weights_and_global_rank_0_writes(tmp_path, ddp_torchrun_uninterrupted):
    out = tmp_path / "two-nodes"  # both agents write here: the shared filesystem
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"multinode-{uuid.uuid4().hex[:8]}"
    agents = {}
    try:
        agents[1] = agent(1, endpoint, rdzv_id, out)
        time.sleep(JOIN_GAP_S)
        agents[0] = agent(0, endpoint, rdzv_id, out)
        results = {node: proc.communicate(timeout=AGENT_TIMEOUT_S) for node, proc in agents.items()}
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node, proc in agents.items():
        assert proc.returncode == 0, f"--node-rank {node}: exit {proc.returncode}\n{results[node][1][-3000:]}"

    # Which agent's worker got RANK 0: the one whose rendezvous result says global_ranks=[0].
    hosts_rank_0 = [node for node, (_, stderr) in results.items() if "global_ranks=[0]" in stderr]
    assert len(hosts_rank_0) == 1, {node: stderr[-2000:] for node, (_, stderr) in results.items()}
    node0, = hosts_rank_0
    other = 1 - node0
    print(f"RANK 0 ran under the agent started with --node-rank {node0}")  # c10d's choice, not --node-rank's
    # Only that process printed: the banner, the epoch line, `done:`; the other printed nothing of the run.
    stdout0, stdout_other = results[node0][0], results[other][0]
    assert "global batch 32 = batch 16 x accumulate 1 x world size 2" in stdout0
    assert "done: " in stdout0 and str(out) in stdout0
    assert "global batch" not in stdout_other and "done: " not in stdout_other, stdout_other
    assert {"last.pt", "metrics.csv", "summary.json"} <= {p.name for p in out.iterdir()}

    single_node, _ = ddp_torchrun_uninterrupted
    diff = max_param_diff(load_model_state(out), load_model_state(single_node))
    print(f"two nodes vs one node: max abs weight diff {diff:.3g}")
    assert diff <= TOL, f"two nodes vs one node: max abs weight diff {diff:.3g}"
