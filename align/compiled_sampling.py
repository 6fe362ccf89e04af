"""The sampling UNet compiled ahead of time (AOTInductor), in a child process (`--compile_sampling`).

Why a child process: compiling in the trainer (torch.compile) imports dynamo and inductor and keeps
their graphs, 100-140 MB more peak memory on the testbed UNet; the child exits once it has written the
package, and the trainer only maps the compiled library (~10 MB on the testbed UNet). The package holds the code, not the
weights: every call binds the UNet's current weights (a LoRA merged into them while sampling), so one
package serves the whole run.

A package is native code, so it never lives in (or loads from) a run folder, which may come from
someone else: packages live in a per-user cache (``cache_root()``: $T2I_ALIGN_CACHE/compiled, else
$XDG_CACHE_HOME/t2i-align/compiled, else ~/.cache/t2i-align/compiled; a 0700 folder owned by this user),
one folder per sha256 of what produced it (the UNet's config, shapes, dtype, device, torch version).
The cache's index.json, written by this user at build time, records the sha256 of each package's bytes;
a package loads only if its bytes still hash to that record (``check_built_here``), so a file planted
or swapped anywhere, the cache included, is refused.

Shapes are fixed at export (a dynamic batch gets guards from the UNet's kernels that narrow its range):
the compiled code takes the sampling batch exactly, any other call runs the eager UNet.

    python -m align.compiled_sampling --model FOLDER --out unet.pt2 --sample 32,4,8,8 --timestep 32 --text 32,77,64
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from align.pipeline import ModelLoadError, check_model, dtype_argument, merged_adapter

PACKAGE_FILE = "sampling_unet.pt2"
KEY_FILE = "sampling_unet.json"  # beside the package: what it was built for (for people; the index is what is trusted)
INDEX_FILE = "index.json"  # in the cache root: entry folder -> sha256 of the package built there
_PREFIX = "unet."  # the exported wrapper's attribute, first in every weight's name


class CompileError(RuntimeError):
    """Building or checking the compiled sampling UNet failed."""


@dataclass(frozen=True)
class SamplingShapes:
    """The one call the package is compiled for: UNet inputs of exactly these shapes and dtype."""

    sample: tuple[int, ...]
    timestep: tuple[int, ...]
    text: tuple[int, ...]
    dtype: str

    def matches(self, sample: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> bool:
        return (
            tuple(sample.shape) == self.sample and tuple(timestep.shape) == self.timestep
            and tuple(text.shape) == self.text and str(sample.dtype) == self.dtype and str(text.dtype) == self.dtype
            and timestep.dtype == torch.int64
        )


class _UNetCall(torch.nn.Module):
    """The sampler's UNet call, positional, one tensor out: what gets exported."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def build_package(model: str, shapes: SamplingShapes, device: str, out: Path) -> None:
    """Export the model's UNet at ``shapes`` and compile it with AOTInductor into ``out`` (the child's job)."""
    from diffusers import UNet2DConditionModel

    dtype = _dtype(shapes.dtype)
    unet = UNet2DConditionModel.from_pretrained(check_model(model), subfolder="unet", **dtype_argument(dtype)).to(device).eval()
    example = (
        torch.zeros(shapes.sample, dtype=dtype, device=device),
        torch.zeros(shapes.timestep, dtype=torch.int64, device=device),
        torch.zeros(shapes.text, dtype=dtype, device=device),
    )
    with torch.no_grad():
        program = torch.export.export(_UNetCall(unet), example, strict=False)
    tmp = out.with_name("partial-" + out.name)  # must end in .pt2
    # Weights stay out of the package: the trainer binds its own at every call (SD v1.5's would be 3.4 GB).
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp), inductor_configs={"aot_inductor.package_constants_in_so": False}
    )
    os.replace(tmp, out)


def cache_root() -> Path:
    """The per-user folder of compiled packages (see the module docstring); created 0700 when first used."""
    base = os.environ.get("T2I_ALIGN_CACHE")
    if base:
        return Path(base).expanduser() / "compiled"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "t2i-align" / "compiled"


def _private_folder(root: Path) -> Path:
    """``root``, created 0700 if missing; refused if another user owns it or others may write into it."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = root.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise CompileError(
            f"the compiled-code cache {root} is not private to this user (owner uid {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}); make it yours with mode 0700 or set T2I_ALIGN_CACHE to another folder"
        )
    return root


def _model_fingerprint(model: str) -> dict:
    """What of the model the compiled code depends on: its UNet's architecture (the weights are bound at
    every call, so they are not part of it)."""
    try:
        resolved = check_model(model)
    except ModelLoadError as err:
        raise CompileError(f"compiling the sampling UNet failed: {err}") from None
    config = Path(resolved).expanduser() / "unet" / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"model": model, "unet_config_sha256": digest}


def _package_key(model: str, shapes: SamplingShapes, device: torch.device) -> dict:
    key = {**_model_fingerprint(model), **asdict(shapes), "device": device.type, "torch": torch.__version__}
    return json.loads(json.dumps(key))  # tuples as lists, as read back from the file


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(root: Path):
    """One writer of the index at a time (processes of one run, or two runs, building at once)."""
    with open(root / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_index(root: Path) -> dict:
    path = root / INDEX_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}  # unreadable: treated as empty, so every package is rebuilt rather than trusted


def _record(root: Path, entry: str, package: Path) -> None:
    with _locked(root):
        index = _read_index(root)
        index[entry] = {"sha256": _file_sha256(package)}
        tmp = root / f".{INDEX_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(index, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, root / INDEX_FILE)


def check_built_here(package: str | Path) -> Path:
    """``package`` if this user's cache index records it with exactly these bytes; else CompileError.

    This is the one gate before native code loads: a package in a run folder, a copied one, or one whose
    bytes changed since it was built here is refused."""
    package = Path(package).resolve()
    root = package.parent.parent
    refused = f"refusing to load compiled code {package}: it was not built on this machine by this user"
    if package.name != PACKAGE_FILE or not (root / INDEX_FILE).is_file():
        raise CompileError(refused + f" (only packages in the private cache {cache_root()} are loaded)")
    _private_folder(root)
    recorded = _read_index(root).get(package.parent.name, {}).get("sha256")
    if not recorded or not package.is_file() or _file_sha256(package) != recorded:
        raise CompileError(refused + " (its bytes do not match the cache's record)")
    return package


def ensure_package(model: str, shapes: SamplingShapes, device: torch.device, cache: Path | None = None) -> tuple[Path, float | None]:
    """The package for these shapes in the per-user ``cache`` (default: ``cache_root()``), built by a child
    process unless one built here for the same key is already there.

    Returns its path and the child's CPU seconds (None when an existing package was reused)."""
    root = _private_folder(Path(cache) if cache is not None else cache_root())
    key = _package_key(model, shapes, device)
    entry = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    folder = root / entry
    package, key_file = folder / PACKAGE_FILE, folder / KEY_FILE
    with contextlib.suppress(CompileError):
        return check_built_here(package), None
    folder.mkdir(exist_ok=True, mode=0o700)
    key_file.unlink(missing_ok=True)
    package.unlink(missing_ok=True)
    print(f"[compile] compiling the sampling UNet for inputs {shapes.sample} in a child process (once per machine; "
          "about 30 CPU-s for the testbed UNet, minutes for SD v1.5) ...", flush=True)
    root_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root_dir, os.environ.get("PYTHONPATH")]))}
    argv = [
        sys.executable, "-m", "align.compiled_sampling", "--model", model, "--out", str(package), "--device", str(device),
        "--sample", ",".join(map(str, shapes.sample)), "--timestep", ",".join(map(str, shapes.timestep)),
        "--text", ",".join(map(str, shapes.text)), "--dtype", shapes.dtype,
    ]
    before = os.times()
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    after = os.times()
    if result.returncode != 0 or not package.is_file():
        raise CompileError(f"compiling the sampling UNet failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    key_file.write_text(json.dumps(key, indent=1) + "\n")
    _record(root, entry, package)
    cpu_seconds = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    print(f"[compile] sampling UNet compiled in a child process: {after.elapsed - before.elapsed:.0f} s, "
          f"{cpu_seconds:.0f} CPU-s", flush=True)
    return package, cpu_seconds


def _weight_slots(unet) -> dict[str, tuple[torch.nn.Module, str]]:
    """Where each weight of the plain UNet lives in ``unet``: its module and attribute name. PEFT's base
    layers are reached through their ``base_layer`` step, which the plain UNet's names lack; the LoRA
    matrices are left out (sampling merges them into the base weights)."""
    slots = {}
    for module_name, module in unet.named_modules():
        parts = module_name.split(".") if module_name else []
        if any(p.startswith("lora_") for p in parts):
            continue
        name = ".".join(p for p in parts if p != "base_layer")
        for attr, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            slots[_PREFIX + (f"{name}.{attr}" if name else attr)] = (module, attr)
    return slots


class CompiledSamplingUNet:
    """Calls like ``unet(sample, timestep, encoder_hidden_states=...)`` and returns an object with
    ``.sample``, as the sampler expects. Inputs of the compiled shapes run the compiled code with the
    UNet's weights as they are at that call; other inputs run ``unet`` itself."""

    def __init__(self, package: Path, unet, shapes: SamplingShapes):
        from peft.tuners.lora import LoraLayer

        self.unet, self.shapes = unet, shapes
        package = check_built_here(package)  # native code: only what this user built on this machine
        # The C++ loader that torch._inductor.aoti_load_package wraps: that wrapper imports inductor's
        # Python package (~6 MB resident, which the out-of-process build exists to avoid) and re-parses
        # the call's tree spec on every call (~7 ms on the testbed UNet, a fifth of the compiled call).
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        slots = _weight_slots(unet)
        names = list(self.loader.get_constant_fqns())
        missing = sorted(set(names) - slots.keys())
        if missing:
            raise CompileError(f"the compiled UNet expects weights this UNet does not have: {missing[:5]}")
        # Weights that train must be inputs of the compiled code, not values baked into it. With a
        # LoRA those are the adapted layers' base weights (sampling merges the update into them).
        trained = {f"{_PREFIX}{n}.weight" for n, m in unet.named_modules() if isinstance(m, LoraLayer)}
        trained |= {_PREFIX + n for n, p in unet.named_parameters() if p.requires_grad and "lora_" not in n}
        baked = sorted(trained - set(names))
        if baked:
            raise CompileError(
                f"{len(baked)} trained weights are compiled in as constants (e.g. {baked[0]}), so sampling would not see "
                "their updates; train without --compile_sampling"
            )
        self.slots = [(name, *slots[name]) for name in names]
        self.bound: tuple[int, ...] | None = None
        self.lora_layers = [m for m in unet.modules() if isinstance(m, LoraLayer)]

    def _bind(self) -> None:
        """Point the compiled code at the UNet's current weight tensors. They are read in place (user
        managed, no copy), so this is needed only when a tensor was replaced, as merging a LoRA does;
        in-place updates are seen as they are."""
        tensors = [getattr(module, attr) for _, module, attr in self.slots]
        pointers = tuple(t.data_ptr() for t in tensors)
        if pointers != self.bound:
            constants = {name: t.detach() for (name, _, _), t in zip(self.slots, tensors)}
            self.loader.load_constants(constants, False, True, True, False)  # active buffer, check all, user managed
            self.bound = pointers

    def __call__(self, sample, timestep, encoder_hidden_states):
        if not self.shapes.matches(sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states)
        if any(not layer.disable_adapters for layer in self.lora_layers):
            raise CompileError("the compiled UNet runs the base weights only: call it inside pipeline.merged_adapter")
        self._bind()
        return SimpleNamespace(sample=self.loader.boxed_run([sample, timestep, encoder_hidden_states])[0])

    def check_against_eager(self, seed: int = 0) -> float:
        """Largest difference from the eager UNet on random inputs of the compiled shapes, relative to the
        output's scale; raises if it is beyond float rounding (inductor has generated wrong CPU kernels)."""
        gen = torch.Generator().manual_seed(seed)
        dtype, device = _dtype(self.shapes.dtype), next(self.unet.parameters()).device
        sample = torch.randn(self.shapes.sample, generator=gen).to(device, dtype)
        timestep = torch.randint(0, 1000, self.shapes.timestep, generator=gen).to(device)
        text = torch.randn(self.shapes.text, generator=gen).to(device, dtype)
        with torch.no_grad(), merged_adapter(self.unet):
            eager = self.unet(sample, timestep, encoder_hidden_states=text).sample.float()
            compiled = self(sample, timestep, text).sample.float()
        error = float((compiled - eager).abs().max() / eager.abs().max().clamp(min=1e-6))
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        if not error <= tolerance:
            raise CompileError(f"the compiled sampling UNet disagrees with the eager one (relative error {error:.2e} > "
                               f"{tolerance:g}); train without --compile_sampling")
        return error


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Compile a pipeline's UNet for one sampling call shape (AOTInductor).")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sample", required=True, help="latents shape, e.g. 32,4,8,8 (the classifier-free guidance batch)")
    p.add_argument("--timestep", required=True, help="timestep shape, e.g. 32")
    p.add_argument("--text", required=True, help="text embedding shape, e.g. 32,77,768")
    p.add_argument("--dtype", default="torch.float32")
    args = p.parse_args(argv)

    def shape(text: str) -> tuple[int, ...]:
        return tuple(int(v) for v in text.split(","))

    shapes = SamplingShapes(shape(args.sample), shape(args.timestep), shape(args.text), args.dtype)
    build_package(args.model, shapes, args.device, Path(args.out))


if __name__ == "__main__":
    main()
