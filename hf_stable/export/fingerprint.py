"""A fingerprint of a base checkpoint's weights, read from its safetensors files on disk.

The reference recorded at the end of training carries the fingerprint of the base the adapter was trained on; the
export computes it again for the base it merges into, so a base that changed in between (another revision, a
rebuilt embedded base, a different local copy) is named before any logit is compared. It is read from disk, not
from the loaded model, so it is the same whatever dtype or quantization the base was loaded with.

Rule: SHA-256 over every tensor's name, dtype and shape and over its raw bytes, whole for tensors of up to
`WHOLE_ELEMENTS` elements and otherwise `SAMPLED_ROWS` evenly spaced rows. Reading a few rows per tensor keeps it
to seconds on an 8B base (safetensors memory-maps the file and reads only the rows asked for); a wholly different
base changes every row, and a change to a single weight is what the logit comparison catches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WHOLE_ELEMENTS = 1 << 16
SAMPLED_ROWS = 8


def base_directory(name_or_path: str, revision: str | None = None) -> Path | None:
    """The local directory holding `name_or_path`'s files: the path itself, or the Hub cache snapshot (None when the
    model is neither a directory nor in the local Hub cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, offline, not a repo id: no fingerprint, said by the caller
        return None


def _row_bytes(handle, name: str) -> tuple[str, list[int], bytes]:
    import torch

    part = handle.get_slice(name)
    shape = list(part.get_shape())
    numel = 1
    for d in shape:
        numel *= d
    if not shape or numel <= WHOLE_ELEMENTS:
        tensors = [handle.get_tensor(name)]
    else:
        rows = sorted({round(i * (shape[0] - 1) / (SAMPLED_ROWS - 1)) for i in range(SAMPLED_ROWS)})
        tensors = [part[r : r + 1] for r in rows]
    dtype = str(tensors[0].dtype)
    data = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    return dtype, shape, data


def weights_fingerprint(directory: str | Path) -> dict | None:
    """{"sha256", "tensors", "parameters", "files"} of the safetensors weights in `directory`, or None when it holds
    none (a `.bin`-only checkpoint)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    n_tensors = n_params = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                dtype, shape, data = _row_bytes(handle, name)
                digest.update(f"{name}|{dtype}|{shape}|".encode())
                digest.update(hashlib.sha256(data).digest())
                n_tensors += 1
                size = 1
                for d in shape:
                    size *= d
                n_params += size
    return {
        "sha256": digest.hexdigest(),
        "tensors": n_tensors,
        "parameters": n_params,
        "files": [f.name for f in files],
    }
