"""HF-format checkpoints in storage: upload a folder, and get a local folder to load.

transformers and vLLM load from a local folder. For a committed checkpoint on a
local disk that folder is made of symlinks (no copy); on S3 the files are
downloaded once into a cache keyed by the manifest's hash, several at once.
Either way each file is checked against its manifest entry as it is read, and
not hashed again on this machine while its stamp holds (grpo.record.storage.file_digest).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from grpo.errors import one_line
from grpo.record.commit import StageWriter
from grpo.record.counts import cache_root, cache_temp, is_local
from grpo.record.digests import WRITTEN_SIDECAR, file_digest, known_digest, remember_digest, settle, sha256_local
from grpo.record.io import get_files, put_files
from grpo.record.storage import CollectedError, Committed, CorruptArtifactError, check_entry, url_to_fs, verify_files
from grpo.record.weights import meta_model, weights_mismatch

CHECKPOINT_PREFIX = "policy/"
ADAPTER_PREFIX = "adapter/"  # a LoRA policy: peft adapter files on top of the checkpoint under policy/
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")
_LOADED: OrderedDict[tuple, tuple] = OrderedDict()  # (tokenizer, config) by the files they come from
_LOADED_LOCK = threading.Lock()  # a learn in a thread of the flow beside the sampling stages (flows/placement.py)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# what a checkpoint needs from a hub repo: weights, config, tokenizer, chat template, generation config
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class ModelNotFoundError(FileNotFoundError):
    """`model.base_model` names no checkpoint that can be had."""


def fetch_model(spec: str, dst: str | Path) -> str:
    """Copy the HF checkpoint `spec` names into the local folder `dst`; returns where it came from.

    `spec` is a local folder, an fsspec URL (s3://bucket/model), or a hub id resolved through
    huggingface_hub (its cache first; HF_HUB_OFFLINE=1 never goes online).
    """
    if "://" in spec or os.path.isdir(spec):
        fs, root = url_to_fs(spec)
        if not fs.exists(f"{root}/config.json"):
            raise ModelNotFoundError(f"model.base_model {spec}: no config.json, not an HF checkpoint folder")
        fs.get(root.rstrip("/") + "/", str(dst), recursive=True)
        return spec
    if not _HUB_ID.match(spec):
        raise ModelNotFoundError(f"model.base_model {spec}: no such folder, and not a hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(spec, allow_patterns=HUB_FILES)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        offline = " (HF_HUB_OFFLINE is set: only the local cache is used)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ModelNotFoundError(
            f"model.base_model {spec}: no such local folder, and the hub model could not be "
            f"had{offline}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not Path(folder, "config.json").exists():
        raise ModelNotFoundError(f"model.base_model {spec}: the hub snapshot {folder} has no config.json")
    shutil.copytree(folder, dst, dirs_exist_ok=True)  # the cache's symlinks resolved: real files
    return f"hub:{spec}"


def parameter_count(model_dir: str | Path) -> int:
    """Parameters in a folder's safetensors files, read from their headers (no weights loaded)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n += math.prod(st.get_slice(name).get_shape())
    return n


def non_finite_weights(model_dir: str | Path) -> list[str]:
    """Names of the tensors in a folder's safetensors files holding NaN or inf (read one at a time)."""
    import torch
    from safetensors import safe_open

    bad = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(name)
    return bad


DTYPES = ("float32", "bfloat16", "float16")  # what config.json's `dtype` may name and the samplers run


def checkpoint_dtype_name(model_dir: str | Path) -> str:
    """The dtype a checkpoint was saved in: config.json's `dtype` (`torch_dtype` before
    transformers 5); float32 when it names none (or one outside DTYPES)."""
    import json

    path = Path(model_dir, "config.json")
    config = json.loads(path.read_text()) if path.exists() else {}
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPES else "float32"


def checkpoint_dtype(model_dir: str | Path):
    """checkpoint_dtype_name as a torch dtype."""
    import torch

    return getattr(torch, checkpoint_dtype_name(model_dir))


def upload_folder(writer: StageWriter, local_dir: str | Path, prefix: str = CHECKPOINT_PREFIX) -> None:
    """Copy every file of `local_dir` into the attempt under `prefix`, several at once, each hashed from its
    local copy on the way (the commit lists them without reading them back)."""
    files = [p for p in sorted(Path(local_dir).rglob("*")) if p.is_file() and p.name != WRITTEN_SIDECAR]
    put_files(writer.storage.fs, [(str(p), writer.path(prefix + p.relative_to(local_dir).as_posix())) for p in files])


def checkpoint_files(committed: Committed, prefix: str = CHECKPOINT_PREFIX) -> dict[str, str]:
    """{name in the checkpoint folder: storage path} for files under `prefix` of a manifest."""
    return {
        f.path[len(prefix) :]: committed.path(f.path) for f in committed.manifest.files if f.path.startswith(prefix)
    }


def content_hash(committed: Committed, prefix: str = CHECKPOINT_PREFIX) -> str:
    """Hash of the checkpoint's (file name, sha256) pairs: the policy version."""
    pairs = sorted((f.path[len(prefix) :], f.sha256) for f in committed.manifest.files if f.path.startswith(prefix))
    return hashlib.sha256(repr(pairs).encode()).hexdigest()


def local_checkpoint(committed: Committed, prefix: str = CHECKPOINT_PREFIX) -> str:
    """A local folder holding the checkpoint files of `committed` under `prefix`, each checked against its
    manifest entry (CorruptArtifactError or CollectedError in one line): symlinks into a local storage, or
    on S3 a download (once a machine, the cached copy checked at each use)."""
    files = checkpoint_files(committed, prefix)
    if not files:
        raise FileNotFoundError(f"{committed.uri}: manifest lists no checkpoint files under {prefix!r}")
    fs = committed.storage.fs
    key = content_hash(committed, prefix)
    if is_local(fs):  # links point into this storage: key on where they point too
        key = hashlib.sha256((key + repr(sorted(files.items()))).encode()).hexdigest()
        only = {prefix + name for name in files}
        collected = verify_files(committed.storage, committed.attempt_dir, committed.manifest, only=only)
        if collected:
            raise CollectedError(next(iter(collected.values())))
    target = _cached(key)
    if target.exists() and (is_local(fs) or cache_intact(committed, target, prefix)):
        return str(target)
    if target.exists():  # an edited or truncated download: never load it under the committed version
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(cache_temp(target.parent))
    if is_local(fs):
        for name, path in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).symlink_to(path)
    else:
        try:
            download_verified(committed, {prefix + name: str(tmp / name) for name in files})
        except BaseException:  # a damaged file, a dropped connection: no half folder left in the cache
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:
        tmp.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
        return str(target)
    if not is_local(fs):  # the copies are the manifest's bytes: cache_intact need not hash them again
        remember_copies(committed, target, prefix)
    return str(target)


def _cached(key: str) -> Path:
    """The folder of this machine's checkpoint cache holding the checkpoint of content hash `key`."""
    return cache_root() / "checkpoints" / key[:32]


def staging_folder() -> str:
    """A new folder on the checkpoint cache's disk for files that keep_written may later take in (a rename)."""
    return cache_temp(cache_root() / "checkpoints")


def keep_written(committed: Committed, folder: str, prefix: str = CHECKPOINT_PREFIX) -> None:
    """Take the local folder this process uploaded as `committed`'s files under `prefix` into this machine's
    checkpoint cache (local_checkpoint's), its hashes those the upload made: a stage here then reads the policy
    it wrote without a download or a hash (the learner's machine, the next learn). Removed where the cache holds
    it already; on a local storage (links, no cache of copies) removed."""
    target = _cached(content_hash(committed, prefix))
    if is_local(committed.storage.fs) or target.exists() or not checkpoint_files(committed, prefix):
        shutil.rmtree(folder, ignore_errors=True)
        return
    try:
        Path(folder).rename(target)
    except OSError:  # another disk, or made meanwhile: the cache fills on the first read instead
        shutil.rmtree(folder, ignore_errors=True)
        return
    remember_copies(committed, target, prefix, written=True)


def remember_copies(committed: Committed, target: Path, prefix: str = CHECKPOINT_PREFIX, written: bool = False) -> None:
    """Record that the local folder `target` holds `committed`'s files under `prefix` with their manifest hashes
    (a verified download, or `written`: the files this process uploaded, first dated back by settle so their stamps
    are trusted at once), so cache_intact does not hash them again."""
    disk = LocalFileSystem()
    for f in committed.manifest.files:
        if f.path.startswith(prefix):
            if written:
                settle(str(target / f.path[len(prefix) :]))
            remember_digest(disk, str(target / f.path[len(prefix) :]), f.sha256)


def download_verified(committed: Committed, dests: dict[str, str]) -> None:
    """Download files of `committed` ({manifest path: local file}) at once, then check each copy against its
    manifest entry: hashed, unless this machine verified the same object (size, ETag) before."""
    fs, entries = committed.storage.fs, {f.path: f for f in committed.manifest.files}
    paths = {name: committed.path(name) for name in dests}  # CollectedError for a file gc collected
    verified = {}
    for name, path in paths.items():
        try:
            size, digest = known_digest(fs, path)
        except FileNotFoundError:
            raise CorruptArtifactError(f"{committed.storage.uri(path)}: listed in the manifest but missing") from None
        verified[name] = (size, digest) == (entries[name].size, entries[name].sha256)
    get_files(fs, [(paths[name], local) for name, local in dests.items()])
    for name, local in dests.items():
        settle(local)  # dated back: its stamp is trusted at once, and any later write changes it
        entry = entries[name]
        if not verified[name]:
            where, size = committed.storage.uri(paths[name]), os.path.getsize(local)
            check_entry(committed.storage, committed.manifest, entry, where, size, sha256_local(local))
            remember_digest(fs, paths[name], entry.sha256)


def adapter_checkpoint(committed: Committed) -> str | None:
    """A local folder holding the LoRA adapter files of `committed` (a snapshot or a LoRA learn);
    None when it has none (full weights, or the base model itself)."""
    if not checkpoint_files(committed, ADAPTER_PREFIX):
        return None
    return local_checkpoint(committed, ADAPTER_PREFIX)


def policy_folders(policy: Committed, base: Committed | None = None) -> tuple[Committed, str, str | None]:
    """(the committed stage holding the checkpoint, its local folder, the LoRA adapter folder or None) of a
    committed policy: the base, a snapshot or a learn. A LoRA learn holds only adapters: its checkpoint is
    `base`'s."""
    if not checkpoint_files(policy) and base is not None and checkpoint_files(policy, ADAPTER_PREFIX):
        return base, local_checkpoint(base), adapter_checkpoint(policy)
    return policy, local_checkpoint(policy), adapter_checkpoint(policy)


def cache_intact(committed: Committed, target: Path, prefix: str = CHECKPOINT_PREFIX) -> bool:
    """Whether a local copy of `committed`'s files under `prefix` still holds exactly the manifest's bytes (size
    and sha256; a file this machine hashed before is trusted while its size, times and inode hold)."""
    disk = LocalFileSystem()
    for f in committed.manifest.files:
        if f.path.startswith(prefix):
            path = target / f.path[len(prefix) :]
            if not path.is_file() or file_digest(disk, str(path)) != (f.size, f.sha256):
                return False
    return True


def tokenizer_and_config(committed: Committed, prefix: str = CHECKPOINT_PREFIX):
    """The transformers tokenizer and model config of a committed checkpoint.

    Loaded once per distinct set of non-weight files (names and sha256 from the manifest): the
    learner writes new weights every iteration, but its tokenizer and config files stay the
    same, so a warm run loads them once instead of in every stage.
    """
    key = tuple(
        sorted(
            (f.path, f.sha256)
            for f in committed.manifest.files
            if f.path.startswith(prefix) and not f.path.endswith(WEIGHT_SUFFIXES)
        )
    )
    with _LOADED_LOCK:
        loaded = _LOADED.get(key)
    if loaded is None:  # loaded outside the lock: a download must not hold up another thread's hit
        from transformers import AutoConfig, AutoTokenizer

        model_dir = local_checkpoint(committed, prefix)
        loaded = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    with _LOADED_LOCK:
        loaded = _LOADED.setdefault(key, loaded)  # one object a key, whichever thread loaded it first
        _LOADED.move_to_end(key)
        while len(_LOADED) > 4:
            _LOADED.popitem(last=False)
    return loaded


def tokenizer_files(model_dir: str | Path) -> list[str]:
    """The files of `model_dir` a tokenizer takes its vocabulary from: tokenizer.json, a sentencepiece or
    tiktoken model, vocab.json (+ merges.txt) or vocab.txt."""
    patterns = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt")
    return sorted({p.name for pattern in patterns for p in Path(model_dir).glob(pattern)})


def safetensors_shapes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, file name)} from the headers of a folder's safetensors files (no weights read)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape()), f.name
    return shapes


def checkpoint_problem(model_dir: str | Path) -> str | None:
    """What keeps a checkpoint folder from loading, in one line; None when its tokenizer files,
    config.json and weights fit together.

    The model config.json describes is built on the meta device (no memory, no weights), as the architecture it
    names (grpo.record.weights.meta_model: a multimodal checkpoint with its vision tower); each of its tensors, in
    the layout save_pretrained writes (the hub's: MoE experts per expert, a tied lm_head once) or in the model's
    own names, must be in the safetensors headers with its shape there. Quantized checkpoints and weights only
    in .bin files are not compared.
    """
    import json

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not tokenizer_files(model_dir):
        return "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): add the model's tokenizer"
    try:
        model_type = json.loads(Path(model_dir, "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        return f"config.json does not read: {one_line(e)}"
    if model_type not in CONFIG_MAPPING:
        return f"config.json's model_type {model_type!r} is none that transformers {transformers.__version__} knows"
    try:
        config = AutoConfig.from_pretrained(model_dir)
        model = meta_model(config)
    except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a config it cannot build)
        return f"config.json describes no causal LM transformers can build: {one_line(e)}"
    files = safetensors_shapes(model_dir)
    if not files:
        return None if any(Path(model_dir).glob("*.bin")) else "no weight files (*.safetensors)"
    if getattr(config, "quantization_config", None):
        return None
    return weights_mismatch(model, files, model_type)


def carry_checkpoint_files(policy_dir: str, out_dir: str) -> list[str]:
    """Copy what save_pretrained does not write (tokenizer files, chat_template.jinja, special tokens,
    a hub model's extras) from the snapshot into the new checkpoint: every later stage and the user
    load the trained policy exactly like the base. Weights are never carried: the new ones are."""
    written = {f.name for f in Path(out_dir).iterdir()}
    carried = []
    for f in sorted(Path(policy_dir).iterdir()):
        if f.is_file() and f.name not in written and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(f, f"{out_dir}/{f.name}")
            carried.append(f.name)
    return carried
