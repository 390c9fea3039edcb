"""``paratrain ckpt export --format hf|dcp``: a checkpoint as another framework's folder.

The flags and the dispatch only; ``hf_export`` and ``dcp_format`` write the folders.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratrain.checkpoints.format import Checkpoint

FORMATS = ("hf", "dcp")


def add_format_flags(parser: argparse.ArgumentParser) -> None:
    from paratrain.checkpoints.hf_export import DEFAULT_MAX_SHARD_SIZE

    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="write a folder: hf (what from_pretrained loads: model.safetensors, sharded "
        "with an index above --max-shard-size, and config.json) or dcp (what "
        "torch.distributed.checkpoint.load reads: the model under 'model', the optimizer "
        "state under 'optim'); without it, one file chosen by OUT's suffix",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest weights file of --format hf, e.g. 500MB or 2GiB (default "
        f"{DEFAULT_MAX_SHARD_SIZE}, as Hugging Face)",
    )


def export_folder(checkpoint: Checkpoint, out: Path, args: argparse.Namespace) -> int:
    """Write the folder ``args.format`` names; print what was written."""
    if args.format == "hf":
        from paratrain.checkpoints.hf_export import export_hf

        print(export_hf(checkpoint, out, args.max_shard_size))
    else:
        from paratrain.checkpoints.dcp_format import export_dcp

        print(export_dcp(checkpoint, out))
    return 0
