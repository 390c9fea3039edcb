"""The planner: how to split a model over these devices, predicted, explained and checked.

``plan`` measures the model on one process and this machine's collectives once, asks every
strategy what each of its layouts would hold and take (``Strategy.plan_layouts``,
``Strategy.predict``), and chooses the fastest predicted to fit; ``predict`` answers for
one layout. See ``api`` (the calls), ``measure`` and ``machine`` (what is measured),
``choose`` (the ranking, pure) and ``parallel/cost_model`` (the arithmetic's vocabulary).
"""

from paratrain.planner.api import plan, plan_in_job, predict
from paratrain.planner.choose import NoPlanFits, Plan

__all__ = ["NoPlanFits", "Plan", "plan", "plan_in_job", "predict"]
