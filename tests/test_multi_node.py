"""Multi-node runs: the shipped accelerate configs as accelerate's own launcher reads them (no processes), and
Diffusion-DPO as two "machines" of one CPU process each on this computer against one process with twice the
accumulation."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env
from safetensors.torch import load_file
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from align.testing.nodes import launch_cpu_nodes
from align.testing.noise_pairs import write_noise_pairs
from align.testing.two_processes import FSDP2 as FSDP2_LAUNCH
from align.testing.two_processes import free_port
from align.testing.weights import assert_weights_close
from align.train import dpo
from align.train.dpo import DPOConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "accelerate"
MULTI_NODE = ["multi_node_ddp_bf16.yaml", "multi_node_fsdp2_bf16.yaml"]
FSDP2 = ["fsdp2_bf16.yaml", "multi_node_fsdp2_bf16.yaml"]


def launch_env(config: str, machine_rank: int, port: int) -> tuple[dict[str, str], object]:
    """What `accelerate launch --config_file <config> --machine_rank R --main_process_port P` hands torchrun: the
    workers' environment (only what it adds or changes) and the parsed launch arguments."""
    argv = ["--config_file", str(CONFIGS / config), "--machine_rank", str(machine_rank), "--main_process_port", str(port),
            "align/dpo.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}, args


@pytest.mark.parametrize("config", MULTI_NODE)
@pytest.mark.parametrize("machine_rank", [0, 1])
def test_each_machine_runs_its_eight_processes_and_meets_machine_0(config, machine_rank):
    port = free_port()  # machine 0's launcher refuses a port in use
    env, args = launch_env(config, machine_rank, port)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", machine_rank)
    # accelerate's --same_network defaults to False whatever the file says, so torchrun meets at an endpoint
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == f"10.0.0.1:{port}"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env.get("ACCELERATE_USE_FSDP") == ("true" if "fsdp2" in config else None)
    assert "ACCELERATE_USE_DEEPSPEED" not in env


def fsdp_plugin_from(env: dict[str, str]) -> FullyShardedDataParallelPlugin:
    """The plugin an Accelerator builds in a worker from the launcher's FSDP_* variables alone."""
    with mock.patch.dict(os.environ, env, clear=True):
        return FullyShardedDataParallelPlugin()


@pytest.mark.parametrize("config", FSDP2)
def test_fsdp2_configs_give_accelerates_plugin_the_sharding_they_promise(config):
    env, _ = launch_env(config, 0, free_port())
    plugin = fsdp_plugin_from(env)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"  # one part per process in each checkpoint
    # wrapped by the model's own _no_split_modules (diffusers' blocks), since no class list is given
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy and plugin.transformer_cls_names_to_wrap is None
    assert plugin.activation_checkpointing is False  # the trainers' --gradient_checkpointing does it
    assert plugin.cpu_ram_efficient_loading is False  # every process loads the diffusers weights itself
    assert type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # the base policy: nothing offloaded to the CPU


def test_one_machine_and_two_machine_fsdp2_configs_shard_alike():
    one, _ = launch_env("fsdp2_bf16.yaml", 0, free_port())
    two, _ = launch_env("multi_node_fsdp2_bf16.yaml", 1, free_port())
    assert {k: v for k, v in one.items() if k.startswith("FSDP_")} == {k: v for k, v in two.items() if k.startswith("FSDP_")}
    assert load_config_from_file(str(CONFIGS / "fsdp2_bf16.yaml")).num_processes == 8


def test_a_failed_machine_does_not_leave_the_other_waiting(tmp_path):
    """Machine 1's process fails at once while machine 0's would wait for ever: both launches end, 0 killed."""
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    start = time.monotonic()
    node0, node1 = launch_cpu_nodes(str(script), [], timeout=120)
    assert node1.returncode != 0 and node0.returncode == -9
    assert time.monotonic() - start < 100


SETTINGS = dict(finetune="lora", lora_rank=4, resolution=16, train_batch_size=1, learning_rate=1e-3, scale_lr=False,
                lr_warmup_steps=0, beta=100.0, num_inference_steps=2, checkpointing_steps=2, max_steps=3,
                report_to="none")


@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_two_machines_train_as_one_process_with_doubled_accumulation(tiny_model, tmp_path, sharding):
    """Machine ranks 0 and 1, one process each, meeting at 127.0.0.1 (gloo): the global main process alone writes the
    run folder; each process writes its part of a checkpoint into the one staging folder (a filesystem both machines
    see) and machine 0 seals it; the steps and final LoRA equal one process's with gradient accumulation 2. Under
    FSDP2 each machine's part includes its shard of the model and optimiser."""
    pairs = write_noise_pairs(tmp_path, 5, loser_seed_offset=50, alternate_labels=True)
    one = dpo.train(DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(tmp_path / "one"),
                              gradient_accumulation_steps=2, **SETTINGS))
    two = tmp_path / "two"
    argv = ["--model", tiny_model, "--dataset", pairs, "--output-dir", str(two), "--gradient_accumulation_steps", "1",
            *[part for key, value in SETTINGS.items() for part in (f"--{key}", str(value))]]
    node0, node1 = launch_cpu_nodes("align/dpo.py", argv, timeout=300,
                                    launcher_args=FSDP2_LAUNCH if sharding == "fsdp2" else ())
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-3000:] + node1.stderr[-3000:]
    # machine 1's process is its machine's local main process but not the global one: it prints and writes nothing
    assert "processes: 2 | accumulation: 1 | pairs per step: 2" in node0.stdout
    assert "[dpo]" not in node1.stdout

    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    checkpoint = two / "checkpoints" / "step_0000002"
    sealed = json.loads((checkpoint / "state.json").read_text())["files"]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(sealed)  # machine 1's part, sealed by machine 0
    if sharding == "fsdp2":
        assert {f"{part}/__{rank}_0.distcp" for part in ("pytorch_model_fsdp_0", "optimizer_0") for rank in (0, 1)} <= set(sealed)
    assert not list((two / "checkpoints").glob(".*partial"))

    single = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(single, records, strict=True):
        for key in ("loss", "implicit_acc", "model_mse_w", "model_mse_l", "ref_mse_w", "ref_mse_l"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    w1 = load_file(str(one / "final" / "pytorch_lora_weights.safetensors"))
    w2 = load_file(str(two / "final" / "pytorch_lora_weights.safetensors"))
    assert w1.keys() == w2.keys() and any(w1[k].abs().sum() > 0 for k in w1)
    if sharding == "fsdp2":  # the reduce-scatter sums in another order (measured: 1 element of 64 off by 1.5e-6)
        assert_weights_close(w1, w2)
        return
    for key in w1:  # one step moves these weights by ~1e-3: another batch or order would show far above this
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-6)
