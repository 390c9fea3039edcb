"""The tensor-parallel option, as the command line, run files and ``setup`` take it.

``tp_plan`` (a dict) is a keyword of ``setup`` only: a flag cannot spell it.
"""

from __future__ import annotations

from paratrain.parallel.options import StrategyOption

PLAN_KEYWORD = "tp_plan"
"""The ``setup`` keyword naming which layers split how (see ``plan``)."""

TENSOR = StrategyOption(
    "tensor",
    int,
    None,
    "devices each split layer is spread over (tensor parallel; tp: every device when left "
    "out, the others: 1); the devices form replicas x stages x tensor, tensor innermost",
    minimum=1,
)
