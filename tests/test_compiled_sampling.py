"""The sampling UNet compiled ahead of time in a child process (align/compiled_sampling.py).

One package is built for the module (~30 s of compilation); the tests bind it to UNets whose weights
change the way training changes them and compare with the eager UNet.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from align import ddpo
from align.compiled_sampling import (
    INDEX_FILE,
    KEY_FILE,
    PACKAGE_FILE,
    CompiledSamplingUNet,
    CompileError,
    SamplingShapes,
    check_built_here,
    ensure_package,
)
from align.pipeline import add_lora, merged_adapter

pytestmark = pytest.mark.skipif(
    ddpo.compile_toolchain_problem(torch.device("cpu")) is not None, reason="no C++ toolchain for the compiler"
)

ROWS = 4


def unet_of(model: str):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(model, subfolder="unet").eval().requires_grad_(False)  # frozen, as under a LoRA


def shapes_for(unet) -> SamplingShapes:
    size, channels = unet.config.sample_size, unet.config.in_channels
    return SamplingShapes((ROWS, channels, size, size), (ROWS,), (ROWS, 77, unet.config.cross_attention_dim), "torch.float32")


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    path, cpu_seconds = ensure_package(tiny_model, shapes_for(unet_of(tiny_model)), torch.device("cpu"), folder)
    assert cpu_seconds is not None and cpu_seconds > 0  # built by a child process, whose CPU time is counted
    return path


def inputs(shapes: SamplingShapes, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shapes.sample, generator=gen), torch.randint(0, 1000, shapes.timestep, generator=gen),
            torch.randn(shapes.text, generator=gen))


def randomise_lora(unet, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def test_compiled_unet_follows_the_merged_lora_as_it_trains(tiny_model, package):
    unet = unet_of(tiny_model)
    add_lora(unet, rank=4)
    shapes = shapes_for(unet)
    compiled = CompiledSamplingUNet(package, unet, shapes)
    sample, timestep, text = inputs(shapes)
    for step in range(3):  # each sampling phase merges into new weight tensors, which the compiled code must pick up
        randomise_lora(unet, seed=step)
        with torch.no_grad():
            eager = unet(sample, timestep, encoder_hidden_states=text).sample  # through PEFT's layers
            with merged_adapter(unet):
                out = compiled(sample, timestep, text).sample
        assert out.shape == eager.shape
        assert torch.allclose(out, eager, atol=1e-5, rtol=1e-4), step
    assert compiled.check_against_eager() < 1e-4


def test_compiled_unet_sees_weights_updated_in_place(tiny_model, package):
    # The compiled code reads the weight tensors in place: an in-place write needs no re-binding.
    unet = unet_of(tiny_model)
    shapes = shapes_for(unet)
    compiled = CompiledSamplingUNet(package, unet, shapes)
    sample, timestep, text = inputs(shapes)
    with torch.no_grad():
        before = compiled(sample, timestep, text).sample
        unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight.mul_(3.0)
        after = compiled(sample, timestep, text).sample
        eager = unet(sample, timestep, encoder_hidden_states=text).sample
    assert not torch.allclose(before, after, atol=1e-4)
    assert torch.allclose(after, eager, atol=1e-5, rtol=1e-4)


def test_other_shapes_run_the_eager_unet(tiny_model, package):
    unet = unet_of(tiny_model)
    shapes = shapes_for(unet)
    compiled = CompiledSamplingUNet(package, unet, shapes)
    smaller = SamplingShapes((2, *shapes.sample[1:]), (2,), (2, *shapes.text[1:]), shapes.dtype)
    sample, timestep, text = inputs(smaller)
    with torch.no_grad():
        assert torch.equal(compiled(sample, timestep, text).sample, unet(sample, timestep, encoder_hidden_states=text).sample)


def test_a_lora_unet_outside_the_merge_is_refused(tiny_model, package):
    # The compiled code holds the base weights only; with an active unmerged adapter it would drop the LoRA.
    unet = unet_of(tiny_model)
    add_lora(unet, rank=4)
    compiled = CompiledSamplingUNet(package, unet, shapes_for(unet))
    with pytest.raises(CompileError, match="merged_adapter"):
        compiled(*inputs(shapes_for(unet)))


def test_the_package_is_reused_only_for_the_same_model_and_shapes(tiny_model, package, tmp_path):
    cache = package.parent.parent  # the module's private cache
    key = json.loads((package.parent / KEY_FILE).read_text())
    shapes = shapes_for(unet_of(tiny_model))
    assert key["sample"] == list(shapes.sample) and key["model"] == tiny_model and key["unet_config_sha256"]
    stamp = package.stat().st_mtime_ns
    again, cpu_seconds = ensure_package(tiny_model, shapes, torch.device("cpu"), cache)
    assert again == package and cpu_seconds is None and again.stat().st_mtime_ns == stamp
    # Other shapes: a new build in another entry, here one that fails (no such model). It says why and
    # records nothing that could pass a package off as built for the new shapes.
    index = json.loads((cache / INDEX_FILE).read_text())
    other = SamplingShapes((8, 4, 8, 8), (8,), (8, 77, 32), "torch.float32")
    with pytest.raises(CompileError, match="compiling the sampling UNet failed|no such folder"):
        ensure_package(str(tmp_path / "no-such-model"), other, torch.device("cpu"), cache)
    assert json.loads((cache / INDEX_FILE).read_text()) == index


def test_a_package_in_a_run_folder_is_never_loaded(tiny_model, package, tmp_path):
    # A run folder received from someone else, holding a package and its description: native code that
    # would run on --resume. Only what this user's cache index records is loaded.
    planted = tmp_path / "run" / "compiled"
    planted.mkdir(parents=True)
    shutil.copy(package, planted / PACKAGE_FILE)
    shutil.copy(package.parent / KEY_FILE, planted / KEY_FILE)
    with pytest.raises(CompileError, match="not built on this machine"):
        CompiledSamplingUNet(planted / PACKAGE_FILE, unet_of(tiny_model), shapes_for(unet_of(tiny_model)))


def test_a_package_whose_bytes_changed_since_the_build_is_refused(tiny_model, package, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(package.parent.parent, cache)  # the index and the package, then one byte changed
    swapped = cache / package.parent.name / PACKAGE_FILE
    data = bytearray(swapped.read_bytes())
    data[-1] ^= 0xFF
    swapped.write_bytes(bytes(data))
    with pytest.raises(CompileError, match="bytes do not match"):
        CompiledSamplingUNet(swapped, unet_of(tiny_model), shapes_for(unet_of(tiny_model)))
    with pytest.raises(CompileError, match="not private"):  # a cache others may write into is not trusted
        (cache).chmod(0o777)
        check_built_here(cache / package.parent.name / PACKAGE_FILE)


def test_a_unet_without_the_packages_weights_is_refused(tiny_model, package):
    unet = unet_of(tiny_model)
    unet.mid_block = None
    with pytest.raises(CompileError, match="does not have"):
        CompiledSamplingUNet(package, unet, shapes_for(unet_of(tiny_model)))


def test_trained_weights_compiled_in_as_constants_are_refused(tiny_model, package):
    # Inductor compiles some small weights into the code (here the 4-value conv_out bias), where an
    # update would never reach sampling: fine for a LoRA, wrong when every weight trains.
    unet = unet_of(tiny_model)
    baked = {n for n, _ in unet.named_parameters()} - {
        n.removeprefix("unet.") for n in CompiledSamplingUNet(package, unet, shapes_for(unet)).loader.get_constant_fqns()
    }
    assert baked == {"conv_out.bias"}
    with pytest.raises(CompileError, match="compiled in as constants"):
        CompiledSamplingUNet(package, unet.requires_grad_(True), shapes_for(unet))
