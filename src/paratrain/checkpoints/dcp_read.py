"""Reading a PyTorch distributed checkpoint (DCP) folder without running its pickles.

A DCP folder (``torch.distributed.checkpoint.save``, as FSDP2 and torchtitan write them)
holds ``.metadata``, a Python pickle of the checkpoint's table of contents, and
``__<rank>_<n>.distcp`` files of the data. torch's own reader unpickles ``.metadata`` with
``pickle.load`` and non-tensor values with ``torch.load(weights_only=False)``: either
runs whatever code the file names. paratrain reads the folder itself instead:

- ``.metadata`` through ``SafeMetadataUnpickler``, an unpickler whose ``find_class``
  allows only the dataclasses of ``torch.distributed.checkpoint.metadata`` (and
  ``filesystem._StorageInfo``), ``torch.Size``, torch's dtypes, layouts and memory
  formats, and ``pathlib`` paths: the names a DCP table of contents is made of. Any other
  name is refused before it is looked up (Python's "restricting globals" recipe, the
  allow-list idea of ``torch.load(weights_only=True)``). Those classes are plain records:
  building one runs no code of the file's choosing.
- every tensor chunk and every non-tensor value (optimizer hyperparameters) with
  ``torch.load(weights_only=True)``, which DCP's ``torch.save`` framing allows;
- chunks of a tensor saved sharded (several ranks) joined by their offsets, so a folder
  written at any world size reads on one process.

Folders written with storage transforms (compression, DCP's extensions) are refused.
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoints.format import CheckpointError

METADATA_FILE = ".metadata"

_DCP = "torch.distributed.checkpoint"
_ALLOWED_CLASSES = {
    f"{_DCP}.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
"""The names a DCP ``.metadata`` pickle is made of (torch 2.4 to 2.13), besides torch's
dtypes, layouts and memory formats (``_torch_constant``)."""


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global not on the allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and _torch_constant(name):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how Python 3.12 (and Debian's 3.11) pickles an Enum member
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP table of contents")


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as an Enum member's pickle uses it, and nothing else: an allowed Enum
    class and one of its member names (a free ``getattr`` would reach any attribute of an
    allowed class, its functions' globals among them)."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum)
    allowed = allowed and cls.__name__ in _ALLOWED_CLASSES.get(cls.__module__, ())
    if not allowed or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(
            f"builtins.getattr({getattr(cls, '__name__', cls)!r}, {name!r}) is not part of a "
            "DCP table of contents"
        )
    return cls[name]


def _torch_constant(name: str) -> bool:
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def is_dcp_folder(path: str | Path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def read_metadata(folder: Path) -> Any:
    """The folder's table of contents, unpickled with the allow-list."""
    path = folder / METADATA_FILE
    try:
        with path.open("rb") as handle:
            return SafeMetadataUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} names {str(error).split(' is not')[0]}, which is not part of a DCP "
            "table of contents; paratrain unpickles only those classes, so it does not read "
            "this folder."
        ) from None
    except (EOFError, OSError, AttributeError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path} is not a readable DCP table of contents: {error}.") from None


def read_dcp(folder: str | Path) -> dict[str, Any]:
    """Every value in the DCP folder, nested as it was saved (``{"model": {...},
    "optim": {"state": ..., "param_groups": [...]}}``): tensors whole, on the CPU."""
    folder = Path(folder)
    metadata = read_metadata(folder)
    storage = {(index.fqn, _offsets(index.offset)): info for index, info in _items(metadata)}
    flat: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for chunk in entry.chunks:
                part = _load(folder, storage, fqn, _offsets(chunk.offsets))
                if not isinstance(part, torch.Tensor):
                    raise CheckpointError(f"{folder}: {fqn!r} holds no tensor where one is due.")
                region = tuple(
                    slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True)
                )
                tensor[region] = part
            flat[fqn] = tensor
        else:
            flat[fqn] = _load(folder, storage, fqn, None)
    return nest(flat, metadata.planner_data)


def _items(metadata: Any):
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(
            "this DCP folder was written by a storage writer other than the file-system one "
            "(its table of contents lists no files); save it with FileSystemWriter."
        )
    return metadata.storage_data.items()


def _offsets(offset: Any) -> tuple[int, ...] | None:
    return None if offset is None else tuple(int(o) for o in offset)


def _load(folder: Path, storage: dict, fqn: str, offsets: tuple[int, ...] | None) -> Any:
    """One stored item: its bytes read from its file, then ``torch.load(weights_only=True)``."""
    info = storage.get((fqn, offsets))
    if info is None:
        raise CheckpointError(f"{folder} lists {fqn!r} but no file holds it: it is damaged.")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{folder} stores {fqn!r} transformed ({', '.join(info.transform_descriptors)}); "
            "paratrain reads DCP folders saved without storage extensions only."
        )
    path = folder / info.relative_path
    try:
        with path.open("rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        if len(data) != info.length:
            raise EOFError(f"{len(data)} of {info.length} bytes")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain values for {fqn!r}, "
            f"which paratrain never unpickles ({str(error).strip().splitlines()[-1]})."
        ) from None
    except (OSError, EOFError, RuntimeError) as error:
        raise CheckpointError(f"{path} is damaged or truncated ({fqn!r}: {error}).") from None


def nest(flat: dict[str, Any], mapping: Any) -> dict[str, Any]:
    """Undo DCP's flattening: ``mapping`` (the planner's data) gives each flat key's path
    (``"optim.state.0.weight.exp_avg" -> ("optim", "state", "0.weight", "exp_avg")``); a
    list index is an int. Keys without a path (saved unflattened) stay as they are."""
    root: dict[Any, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key, (key,)) if isinstance(mapping, dict) else (key,)
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are 0..n-1 (a flattened list) made lists again."""
    if not isinstance(node, dict):
        return node
    node = {key: _lists(value) for key, value in node.items()}
    if (
        node
        and all(isinstance(key, int) for key in node)
        and sorted(node) == list(range(len(node)))
    ):
        return [node[i] for i in range(len(node))]
    return node


def sections(tree: dict[str, Any], folder: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """(model state by its stored names, optimizer state or None) of a read DCP folder.

    The model is under ``model`` (``dcp.save({"model": ..., "optim": ...})``, as PyTorch's
    tutorials and ``get_state_dict`` make it), perhaps inside one stateful's key (``app``),
    or at the top level (torchtitan); its optimizer beside it under ``optim`` or
    ``optimizer``.
    """
    holders = [tree]
    if len(tree) == 1 and isinstance(next(iter(tree.values())), dict):
        holders.append(next(iter(tree.values())))
    for holder in holders:
        if isinstance(holder.get("model"), dict):
            model, optim = holder["model"], holder.get("optim", holder.get("optimizer"))
            break
    else:
        model = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
        optim = tree.get("optim", tree.get("optimizer"))
    odd = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
    if not model or odd:
        raise CheckpointError(
            f"{folder} holds no model state where DCP checkpoints keep it (a 'model' key of "
            "tensors, or tensors at the top level)"
            + (f"; its 'model' holds {odd[0]!r}, which is no tensor" if odd else "")
            + "."
        )
    return model, optim


def read_dcp_model(folder: str | Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP folder, by their stored names (wrappers included)."""
    return sections(read_dcp(folder), Path(folder))[0]
