"""``paratrain ckpt inspect|export``: look into a checkpoint, or turn it into one plain file
(or, with ``--format``, a Hugging Face or DCP folder: ``cli/ckpt_formats.py``)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from paratrain.checkpoints.file_modes import match_umask
from paratrain.checkpoints.format import Checkpoint
from paratrain.config import ConfigError
from paratrain.reports.metrics_file import format_bytes


def _open(path: str) -> Checkpoint:
    from paratrain.checkpoints.locate import find_checkpoint

    return Checkpoint(find_checkpoint(path))


def inspect_command(args: argparse.Namespace) -> int:
    checkpoint = _open(args.path)
    manifest = checkpoint.manifest
    model = checkpoint.model_state()
    aliases = checkpoint.aliases
    parameters = sum(t.numel() for name, t in model.items() if name not in aliases)
    layout = ", ".join(f"{k}={v}" for k, v in manifest.get("layout", {}).items())
    lines = [
        f"checkpoint {checkpoint.directory}: format version {manifest['version']}, "
        f"step {checkpoint.step}, checksums verified",
        f"  saved from        {layout}",
        f"  model             {len(model) - len(aliases)} tensors, {parameters:,} values",
    ]
    if aliases:
        ties = ", ".join(f"{alias} = {canonical}" for alias, canonical in aliases.items())
        lines.append(f"  tied names        {ties} (stored once)")
    optim_keys = Counter(name.rpartition("/")[2] for name in checkpoint.names("optim"))
    if optim_keys:
        groups = (manifest.get("optimizer") or {}).get("param_groups", [])
        hyper = {k: v for k, v in (groups[0] if groups else {}).items() if k != "params"}
        summary = ", ".join(f"{key} x{count}" for key, count in sorted(optim_keys.items()))
        lines.append(f"  optimizer state   {summary}")
        lines.append(f"  hyperparameters   {hyper}")
    if checkpoint.metadata:
        lines.append(f"  metadata          {', '.join(sorted(checkpoint.metadata))}")
    lines.append("  files:")
    for name, entry in sorted(manifest["files"].items()):
        lines.append(
            f"    {name:<28}{format_bytes(entry['bytes']):>10}  sha256 {entry['sha256'][:16]}"
        )
    width = max(len(name) for name in model) if model else 0
    lines.append("  model tensors:")
    for name, tensor in model.items():
        if name in aliases:
            lines.append(f"    {name:<{width}}  tied to {aliases[name]}")
        else:
            lines.append(f"    {name:<{width}}  {str(tuple(tensor.shape)):<16} {tensor.dtype}")
    print("\n".join(lines))
    return 0


def export_command(args: argparse.Namespace) -> int:
    checkpoint = _open(args.path)
    out = Path(args.out)
    if getattr(args, "format", None):
        from paratrain.cli.ckpt_formats import export_folder

        return export_folder(checkpoint, out, args)
    state = checkpoint.model_state()  # every name; tied names share one tensor
    out.parent.mkdir(parents=True, exist_ok=True)
    note = ""
    if out.suffix == ".safetensors":
        # safetensors stores no shared tensors: a tied name gets its own copy, so the file
        # is still a complete state dict for load_state_dict(strict=True)
        copies = {name: state[name].clone() for name in checkpoint.aliases}
        save_file({**state, **copies}, str(out))
        match_umask(out)  # save_file creates 0600 files whatever the umask
        if copies:
            note = f" ({len(copies)} tied name(s) written as copies: {', '.join(copies)})"
    elif out.suffix in (".pt", ".pth"):
        torch.save(state, out)  # tensors only: torch.load(out, weights_only=True) reads it
    else:
        raise ConfigError(
            f"export writes .safetensors or .pt files, or a folder with --format hf or dcp, "
            f"not {out.name!r}."
        )
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {out}: {len(state)} tensors, {format_bytes(total)}, step {checkpoint.step}{note}")
    return 0
