"""DDP on CUDA with nccl: skipped without the GPUs, run on a machine with them (marker `gpu`).

The CPU tests prove the loop; these prove the same script runs unchanged where it matters: nccl, one GPU per
rank (cuda:LOCAL_RANK bound before init_process_group), and --sync-bn, which works on CUDA only.
GPU reductions are ordered differently for a batch of 16 and one of 32, so the tolerances are 1e-5 for the
fp32 MLP (matmuls do not use TF32 by default) and looser where cuDNN convolutions (TF32 by default) run.
"""
from __future__ import annotations

import json

from conftest import cuda_devices, load_model_state, max_param_diff, run_ok, torchrun

FLAGS = ["--device", "cuda", "--deterministic", "--lr", "0.2", "--no-progress"]


class TestOneGPU:
    pytestmark = cuda_devices(1)

    def test_plain_python_on_one_gpu_is_an_nccl_group_of_one_equal_to_the_baseline(self, tmp_path):
        a, b = tmp_path / "ddp", tmp_path / "single"
        proc = run_ok("ddp", "--model", "mlp", "--batch-size", "32", "--epochs", "1", "--out-dir", str(a), *FLAGS)
        assert "device cuda:0" in proc.stdout
        run_ok("single", "--model", "mlp", "--batch-size", "32", "--epochs", "1", "--out-dir", str(b), *FLAGS)
        assert max_param_diff(load_model_state(a), load_model_state(b)) < 1e-6

    def test_sync_bn_on_one_gpu_runs_and_equals_the_baseline(self, tmp_path):
        """--sync-bn on CUDA, one rank: convert_sync_batchnorm, DDP and nccl set up and train. SyncBatchNorm over
        one rank normalises with the local batch's statistics (it syncs only when the world is larger), so the
        weights are the single-GPU run's: same kernels, and DDP's all-reduce over one rank changes no bit."""
        common = ["--model", "resnet18", "--batch-size", "32", "--max-steps", "10", *FLAGS, "--lr", "0.05"]
        synced, single = tmp_path / "sync", tmp_path / "single"
        proc = run_ok("ddp", "--sync-bn", "--out-dir", str(synced), *common)
        assert "device cuda:0" in proc.stdout
        run_ok("single", "--out-dir", str(single), *common)
        ours, reference = load_model_state(synced), load_model_state(single)
        assert ours.keys() == reference.keys()  # SyncBatchNorm keeps BatchNorm2d's state: a plain checkpoint
        assert max_param_diff(ours, reference) < 1e-5


class TestTwoGPUs:
    pytestmark = cuda_devices(2)

    def test_nccl_two_gpus_with_batch_16_equal_one_gpu_with_batch_32(self, tmp_path):
        a, b = tmp_path / "ddp", tmp_path / "single"
        proc = run_ok("ddp", "--model", "mlp", "--batch-size", "16", "--epochs", "1", "--out-dir", str(a), *FLAGS,
                      launcher=torchrun(2))
        assert "world size 2" in proc.stdout
        assert json.loads((a / "summary.json").read_text())["device"] == "cuda:0"  # rank 0's GPU
        run_ok("single", "--model", "mlp", "--batch-size", "32", "--epochs", "1", "--out-dir", str(b), *FLAGS)
        assert max_param_diff(load_model_state(a), load_model_state(b)) < 1e-5

    def test_sync_bn_batch_statistics_over_the_global_batch(self, tmp_path):
        """resnet18 has BatchNorm: with --sync-bn, 2 x 16 normalise over all 32 samples, as one process does;
        without it each rank normalises over its own 16 and trains a different model."""
        common = ["--model", "resnet18", "--max-steps", "10", *FLAGS]
        synced, local, single = tmp_path / "sync", tmp_path / "local", tmp_path / "single"
        run_ok("ddp", "--batch-size", "16", "--sync-bn", "--out-dir", str(synced), *common, launcher=torchrun(2))
        run_ok("ddp", "--batch-size", "16", "--out-dir", str(local), *common, launcher=torchrun(2))
        run_ok("single", "--batch-size", "32", "--out-dir", str(single), *common)
        reference = load_model_state(single)
        synced_diff = max_param_diff(load_model_state(synced), reference)
        local_diff = max_param_diff(load_model_state(local), reference)
        assert synced_diff < 1e-3  # TF32 cuDNN convolutions: a loose tolerance ...
        assert local_diff > 10 * synced_diff  # ... that still tells per-rank statistics apart
