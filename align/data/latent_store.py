"""A latent store: VAE latents and text embeddings of preference pairs, computed once, on disk.

Layout of a store folder:
    manifest.json              what was encoded: model fingerprint, resolution, dataset fingerprint,
                               number of pairs, shard size, dtype, shapes; "complete" once all shards exist
    empty_text.safetensors     the conditioning of "" (caption dropout): cond.<key> for each key
    shard_00000.safetensors    pairs [0, S): latents [n, 2 flips, 2 (winner, loser), C, h, w],
                               cond.<key> [U, ...] for every key of the model family's conditioning
                               (prompt_embeds; pooled_embeds, time_ids, ... where the family has them)
                               of the shard's U distinct captions, caption_index [n], rows [n]
    ...

Each shard is written atomically (temporary file, then rename), so an interrupted build keeps its
finished shards and a rerun encodes only the missing ones, giving the same bytes as a build that was
never interrupted. Training memory-maps the shards (safetensors) and reads one pair at a time.

A store may hold some of the pairs only: a training run's own store (--latent_store run) encodes the pairs
that run reads (a ten-step test on a million pairs encodes ten steps' pairs), and a longer or resumed run
adds the ones it lacks as new shards (a write-through cache). Each shard's ``pairs`` tensor names the pair
indices it holds (a store written before it held pairs [i*S, (i+1)*S) in shard i). The manifest records
every shard's size, hash and pair count and its own digest: a store is checked against it when opened
(a truncated shard, an edited manifest: one line before any work); see docs/scale.md.

What is stored: the centre crop at the training resolution, un-flipped AND flipped (the flip is drawn
at train time), and the VAE posterior's mean times the scaling factor, exactly what the trainer
encodes when it reads images (the family's encode_images / encode_prompts), so training from a store is
training from the images with the same latents and conditioning. A manifest without its digest (stores written
before it, format 1) is refused: nothing vouches for it. The official Diffusion-DPO code draws ``latent_dist.sample()``
at every step instead; see docs/scale.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from align.data.pairs import DataError
from align.families import family_of, family_of_pipeline
from align.families.base import cat_conditioning
from align.pipeline import resolve_model
from align.run_folder import atomic_path, atomic_write_text, file_sha256, record_digest, seal

STORE_FORMAT = 2
READABLE_FORMATS = (2,)  # format 1 (before conditioning dicts) had no digest: refused, like every store without one
COND_PREFIX = "cond."  # a conditioning key's tensor name in the files and in the items read
MANIFEST = "manifest.json"
EMPTY_TEXT = "empty_text.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FINGERPRINTED_PARTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
                       "processor")  # Qwen-Image-Edit's processor: how the source image reaches the text encoder


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


# ------------------------------------------------------------------------------------ fingerprints


def model_folder(model: str) -> Path:
    """The local folder of a pipeline: the folder given, or a hub id's Hugging Face cache snapshot."""
    resolved = resolve_model(model)
    folder = Path(resolved).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved, local_files_only=True, allow_patterns=[f"{p}/*" for p in FINGERPRINTED_PARTS] + ["model_index.json", "unet/config.json", "transformer/config.json"]))
    except Exception as err:  # not cached (offline or never downloaded)
        raise DataError(
            f"--model {model!r}: cannot find its files to fingerprint ({type(err).__name__}); "
            "give a local pipeline folder or load the model once so it is in the Hugging Face cache"
        ) from None


def model_fingerprint(model: str) -> str:
    """sha256 over the VAE's, text encoders' and tokenizers' files (configs and weights); the parts a
    family lacks (text_encoder_2, ...) are absent from the digest, so SD 1.x/2.x digests are unchanged."""
    folder = model_folder(model)
    digest = hashlib.sha256()
    for part in FINGERPRINTED_PARTS:
        for path in sorted(p for p in (folder / part).rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(folder)).encode())
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()[:32]


def native_resolution(model: str) -> int:
    """The pipeline's own image size, from its config files (the family's rule: align/families)."""
    folder = model_folder(model)
    family = family_of(str(folder))
    denoiser = json.loads((folder / family.denoiser_name / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    return family.native_resolution_of(denoiser, vae)


# -------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class StoreSpec:
    """What a store was built from; two builds with equal specs give the same bytes."""

    model_fingerprint: str
    resolution: int
    dataset_fingerprint: str
    num_pairs: int
    shard_size: int
    dtype: str

    @property
    def num_shards(self) -> int:
        return -(-self.num_pairs // self.shard_size)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def manifest_digest(manifest: dict) -> str:
    """The digest a manifest carries of its other fields: an edit by hand (resolution, pair count) is seen."""
    return record_digest(manifest)


def write_manifest(store: Path, manifest: dict) -> None:
    atomic_write_text(store / MANIFEST, json.dumps(seal(manifest), indent=2))


def check_store_path(store: str | Path) -> None:
    """A store is a folder (or one to be made): a file, a dangling link or a file on its path is one line."""
    store = Path(store)
    if store.is_symlink() and not store.exists():
        raise DataError(f"latent store {str(store)!r} is a link to nothing ({store.readlink()}); give a store folder")
    if store.exists() and not store.is_dir():
        raise DataError(f"latent store {str(store)!r} is a file, not a store folder; give a folder (new, or one built "
                        "by python -m align.precompute)")
    blocking = next((p for p in store.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise DataError(f"latent store {str(store)!r} cannot be a folder: {str(blocking)!r} on its path is a file")


def read_manifest(store: str | Path) -> dict | None:
    check_store_path(store)
    path = Path(store) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"latent store {str(store)!r}: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"latent store {str(store)!r} has format {found!r}; this version reads "
                        f"{', '.join(map(str, READABLE_FORMATS))}; rebuild the store (python -m align.precompute)")
    if "digest" not in manifest:  # nothing vouches for what it says (issue 61: a 16 px store trained as 32 px)
        raise DataError(f"latent store {str(store)!r}: {MANIFEST} carries no digest (edited by hand, or written by a "
                        "version before stores were verified), so what it says of its latents cannot be trusted; "
                        "rebuild the store (python -m align.precompute into a new folder, or delete the run's latents/)")
    if manifest["digest"] != manifest_digest(manifest):
        raise DataError(f"latent store {str(store)!r}: {MANIFEST} was changed after the store was written (its digest "
                        "does not match); rebuild the store (python -m align.precompute, or delete the run's latents/)")
    return manifest


# Shards are hashed when a store is opened while the store is at most this large (a test or a short run's store:
# well under a second); larger stores are checked by size and header alone (reading them whole at every start
# would cost minutes: docs/scale.md).
HASH_AT_OPEN_BYTES = 1 << 30


SHARD_RECORD = ("size", "sha256", "pairs")  # what the manifest records of each shard (all of it is checked)


def shard_records(store: Path, manifest: dict) -> dict[str, dict]:
    """{file: {size, sha256, pairs}} of the store's shards, each record whole (else one line: nothing to check
    that shard against)."""
    records = manifest.get("shards")
    if not isinstance(records, dict):
        raise DataError(f"latent store {str(store)!r}: {MANIFEST} lists no shards; rebuild the store")
    for name, record in records.items():
        if not isinstance(record, dict) or any(key not in record for key in SHARD_RECORD):
            raise DataError(f"latent store {str(store)!r}: {MANIFEST} does not record {name}'s "
                            f"{', '.join(SHARD_RECORD)}; rebuild the store")
    return records


def shard_pairs(store: Path, name: str, manifest: dict) -> torch.Tensor:
    """The pair indices shard ``name`` holds (its ``pairs`` tensor)."""
    from safetensors import safe_open

    with safe_open(str(store / name), framework="pt") as handle:
        return handle.get_tensor("pairs")


def check_shards(store: Path, manifest: dict) -> None:
    """Every shard the manifest lists is there, of its recorded size (and hash, for a store of at most
    HASH_AT_OPEN_BYTES), its header readable, and the pairs held add up to the manifest's count."""
    from safetensors import safe_open

    records = shard_records(store, manifest)
    total = sum(int(r["size"]) for r in records.values())
    held = 0
    for name, record in records.items():
        path = store / name
        where = f"latent store {str(store)!r}: {name}"
        if not path.is_file():
            raise DataError(f"{where} is missing; rebuild the store (or delete the run's latents/ to re-encode)")
        if path.stat().st_size != record["size"]:
            raise DataError(f"{where} is {path.stat().st_size} bytes, {record['size']} were written (truncated or "
                            "changed); rebuild the store (or delete the run's latents/ to re-encode)")
        if total <= HASH_AT_OPEN_BYTES:
            if file_sha256(path) != record["sha256"]:
                raise DataError(f"{where} has changed since it was written (hash mismatch); rebuild the store")
        try:
            with safe_open(str(path), framework="pt") as handle:
                count = handle.get_slice("latents").get_shape()[0]
                pairs = handle.get_slice("pairs").get_shape()[0]
        except Exception as err:  # safetensors' errors: a damaged header, a tensor missing
            raise DataError(f"{where} is not a readable shard ({type(err).__name__}); rebuild the store") from None
        if count != record["pairs"] or pairs != count:
            raise DataError(f"{where} holds {count} pairs, the manifest says {record['pairs']}; rebuild the store")
        held += count
    if manifest.get("complete") and held != manifest["num_pairs"]:
        raise DataError(f"latent store {str(store)!r} holds {held} pairs but its manifest says {manifest['num_pairs']}; "
                        "rebuild the store")


def check_store(store: str | Path, model_fp: str, resolution: int, dataset_fp: str | tuple[str, ...] | None = None,
                need_complete: bool = True) -> dict:
    """The manifest of a store that fits this model, resolution (and dataset: its content fingerprint, or any of a
    tuple of accepted ones: a store built before content fingerprints holds the older one); else one clear line."""
    manifest = read_manifest(store)
    if manifest is None:
        raise DataError(f"latent store {str(store)!r} not found (no {MANIFEST}); build it with python -m align.precompute")
    if manifest["model_fingerprint"] != model_fp:
        raise DataError(
            f"latent store {str(store)!r} was encoded by another model (VAE/text encoder fingerprint "
            f"{manifest['model_fingerprint'][:12]}, this model's {model_fp[:12]}); rebuild it for this --model"
        )
    if manifest["resolution"] != resolution:
        raise DataError(
            f"latent store {str(store)!r} holds {manifest['resolution']} px latents but this run trains at "
            f"{resolution} px; pass --resolution {manifest['resolution']} or rebuild the store"
        )
    accepted = (dataset_fp,) if isinstance(dataset_fp, str) else tuple(filter(None, dataset_fp or ()))
    if accepted and manifest["dataset_fingerprint"] not in accepted:
        raise DataError(
            f"latent store {str(store)!r} was built from other pairs (dataset fingerprint "
            f"{manifest['dataset_fingerprint']}, this --dataset/--tie_policy/--max_pairs gives {accepted[0]})"
        )
    if need_complete and not manifest.get("complete"):
        raise DataError(
            f"latent store {str(store)!r} is incomplete (an interrupted build); rerun python -m align.precompute "
            "with the same arguments to finish it"
        )
    check_shards(Path(store), manifest)
    return manifest


# ----------------------------------------------------------------------------------------- build


def prepare_store(store: str | Path, spec: StoreSpec) -> None:
    """Refuse a folder holding something else; write the manifest of a new build (incomplete)."""
    store = Path(store)
    manifest = read_manifest(store)
    if manifest is not None:
        held = {k: manifest.get(k) for k in spec.as_dict()}
        if held != spec.as_dict():
            changed = ", ".join(f"{k} {held[k]!r} -> {v!r}" for k, v in spec.as_dict().items() if held[k] != v)
            raise DataError(
                f"latent store {str(store)!r} holds another build ({changed}); give a new --output folder"
            )
        return
    if store.exists() and any(store.iterdir()):
        raise DataError(f"--output {str(store)!r} is a non-empty folder without a {MANIFEST}; give a new or empty folder")
    store.mkdir(parents=True, exist_ok=True)
    write_manifest(store, {"format": STORE_FORMAT, **spec.as_dict(), "complete": False, "shards": {}})


def held_pairs(store: Path, manifest: dict) -> torch.Tensor:
    """The pair indices a store holds (sorted)."""
    held = [shard_pairs(store, name, manifest) for name in shard_records(store, manifest)]
    return torch.cat(held).sort().values if held else torch.zeros(0, dtype=torch.int64)


def build_store(pipe, table, store: str | Path, spec: StoreSpec, batch_size: int = 8, log=print, after_shard=None,
                pairs=None) -> dict:
    """Encode the pairs of ``table`` (align.data.pair_stream.PairTable) into ``store``: all of them, or those of
    ``pairs`` (pair indices: what a run reads). Pairs already held are skipped, the others are encoded in their
    index order in shards of ``spec.shard_size``, so an interrupted build resumes to the same bytes. The time the
    whole encoding takes is estimated once, early (estimate), and again after each shard. Returns the manifest."""
    from safetensors.torch import save_file

    store = Path(store)
    prepare_store(store, spec)
    manifest = read_manifest(store)
    records = dict(shard_records(store, manifest))
    dtype = DTYPES[spec.dtype]
    if not (store / EMPTY_TEXT).is_file():
        with torch.no_grad(), atomic_path(store / EMPTY_TEXT) as tmp:
            empty = family_of_pipeline(pipe).encode_prompts(pipe, [""], spec.resolution)
            save_file({COND_PREFIX + key: stored(value[0], dtype) for key, value in empty.items()}, str(tmp))
    wanted = torch.arange(spec.num_pairs) if pairs is None else torch.as_tensor(pairs, dtype=torch.int64).unique()
    held = held_pairs(store, manifest)
    missing = wanted[~torch.isin(wanted, held)]
    chunks = [chunk for chunk in missing.split(spec.shard_size) if len(chunk)]
    started = time.perf_counter()
    estimated = False

    def estimate(done: int) -> None:
        """The whole encoding's duration, said once: after 10 seconds or an eighth of the work, whichever first."""
        nonlocal estimated
        spent = time.perf_counter() - started
        if not estimated and done and (spent >= 10 or done * 8 >= len(missing)) and done < len(missing):
            estimated = True
            log(f"[latents] {done:,} of {len(missing):,} pairs encoded in {_duration(spent)}: about "
                f"{_duration(spent / done * (len(missing) - done))} left")

    encoded = 0  # pairs of ``missing`` encoded so far
    for number, chunk in enumerate(chunks):
        path = store / shard_name(len(records))
        tensors = encode_shard(pipe, table.remapped(), chunk.tolist(), spec.resolution, batch_size,
                               progress=lambda done, before=encoded: estimate(before + done))
        with atomic_path(path) as tmp:
            save_file({k: stored(v, dtype) for k, v in tensors.items()}, str(tmp))
        records[path.name] = {"size": path.stat().st_size, "sha256": file_sha256(path), "pairs": len(chunk)}
        write_manifest(store, {**manifest, "shards": records})
        encoded += len(chunk)
        left = ""
        if encoded < len(missing):
            per_pair = (time.perf_counter() - started) / encoded
            left = f"; about {_duration(per_pair * (len(missing) - encoded))} left"
        log(f"[latents] shard {number + 1}/{len(chunks)} ({len(chunk)} pairs) -> {path}{left}")
        if after_shard is not None:
            after_shard(number)
    complete = len(held) + len(missing) == spec.num_pairs  # what was held, and what this build added
    manifest = {**manifest, "complete": complete, "shards": records}
    write_manifest(store, manifest)
    return read_manifest(store)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def stored(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as the store holds it: floating ones in the store's dtype (integer ones as they are), on the CPU."""
    return (value.to(dtype) if value.is_floating_point() else value).contiguous().cpu()


@torch.no_grad()
def encode_shard(pipe, table, indices, resolution: int, batch_size: int, progress=None) -> dict[str, torch.Tensor]:
    """Latents of both images of each pair of ``indices`` (a list of pair indices), un-flipped and flipped, the
    shard's caption conditioning, and the pair indices held (``pairs``); ``progress(pairs done)`` after each batch."""
    family = family_of_pipeline(pipe)
    latents = []
    indices = list(indices)
    for start in range(0, len(indices), batch_size):
        pixels = []
        for k in indices[start : start + batch_size]:
            pair = table.pair(k)
            for flip in (False, True):
                pixels.extend(table.pair_pixels(pair, resolution, flip))  # winner, loser
        encoded = family.encode_images(pipe, torch.stack(pixels)).float().cpu()
        latents.append(encoded.reshape(-1, 2, 2, *encoded.shape[1:]))  # [pairs, flip, (w, l), C, h, w]
        if progress is not None:
            progress(min(len(indices), start + batch_size))
    captions = [table.caption(k) for k in indices]
    distinct = sorted(set(captions))
    position = {c: i for i, c in enumerate(distinct)}
    cond = cat_conditioning([family.encode_prompts(pipe, distinct[i : i + batch_size], resolution)
                             for i in range(0, len(distinct), batch_size)])
    return {
        "latents": torch.cat(latents),
        **{COND_PREFIX + key: (value.float() if value.is_floating_point() else value).cpu() for key, value in cond.items()},
        "caption_index": torch.tensor([position[c] for c in captions], dtype=torch.int64),
        "rows": torch.from_numpy(table.rows[indices].copy()),
        "pairs": torch.tensor(indices, dtype=torch.int64),
    }


# ------------------------------------------------------------------------------------------ read


def cond_names(names) -> dict[str, str]:
    """Tensor name in a store file -> item key (``cond.<key>``)."""
    return {name: name for name in names if name.startswith(COND_PREFIX)}


def as_float(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.is_floating_point() else value


class StoreLatents(torch.utils.data.Dataset):
    """Items (k, flip, drop) -> winner/loser latents and the conditioning under ``cond.<key>`` (that of ""
    when dropped), read from the memory-mapped shards (each DataLoader worker opens its own handles)."""

    def __init__(self, store: str | Path, manifest: dict):
        self.store, self.shard_size, self.num_pairs = Path(store), manifest["shard_size"], manifest["num_pairs"]
        self._handles: dict[int, object] = {}
        self._empty: dict[str, torch.Tensor] | None = None
        # Where each pair is: shard file and position in it (-1: not held; a run's store holds the run's pairs).
        self.shard_files = list(shard_records(self.store, manifest))
        self.where = torch.full((self.num_pairs,), -1, dtype=torch.int32)
        self.position = torch.zeros(self.num_pairs, dtype=torch.int32)
        for index, name in enumerate(self.shard_files):
            held = shard_pairs(self.store, name, manifest)
            self.where[held] = index
            self.position[held] = torch.arange(len(held), dtype=torch.int32)

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}  # file handles are per process

    def __len__(self) -> int:
        return self.num_pairs

    def _shard(self, index: int):
        from safetensors import safe_open

        if index not in self._handles:
            if len(self._handles) >= 2:  # close older maps: the pages read through them leave the RSS
                self._handles.clear()
            self._handles[index] = safe_open(str(self.store / self.shard_files[index]), framework="pt")
        return self._handles[index]

    def __getitem__(self, key: tuple[int, bool, bool]) -> dict:
        try:
            return self._read(*key)
        except (OSError, KeyError, RuntimeError) as err:  # a shard removed or damaged after the check
            return {"error": f"latent store {str(self.store)!r}: cannot read pair {key[0]}: {type(err).__name__}: {err}"}

    def _read(self, k: int, flip: bool, drop: bool) -> dict:
        from safetensors.torch import load_file

        if self.where[k] < 0:
            raise KeyError(f"the store does not hold pair {k} (it holds the pairs of the run that built it)")
        handle = self._shard(int(self.where[k]))
        i = int(self.position[k])
        pair = handle.get_slice("latents")[i : i + 1][0, int(flip)].float()
        names = cond_names(handle.keys())
        if drop:
            if self._empty is None:
                empty = load_file(str(self.store / EMPTY_TEXT))
                self._empty = {key: as_float(empty[name]) for name, key in cond_names(empty.keys()).items()}
            cond = dict(self._empty)
            # an editing family's caption also conditions on its source image, which a dropped instruction keeps
            names = {name: key for name, key in names.items() if key not in cond}
        else:
            cond = {}
        if names:
            caption = int(handle.get_slice("caption_index")[i : i + 1][0])
            cond.update({key: as_float(handle.get_slice(name)[caption : caption + 1][0]) for name, key in names.items()})
        return {"latents_w": pair[0], "latents_l": pair[1], **cond}


__all__ = ["COND_PREFIX", "DTYPES", "StoreLatents", "StoreSpec", "build_store", "check_store", "model_fingerprint", "native_resolution", "read_manifest"]
