"""``strategy="pipeline"``: contiguous stages of the model, fed micro-batches.

description.py      the strategy before any worker starts (layout, refusals, planning)
engine.py           the engine (GPipe/1F1B/interleaved 1F1B, recompute, dp x pp hybrid)
chunks.py           a worker's virtual stages (interleaved 1F1B): pieces, links
cost.py             the planner's arithmetic (balance, in-flight micro-batches, the
                    schedule's lists replayed on the priced passes)
options.py          its options (stages, micro-batches, schedule, balance, split points)
split_points.py     a model that is no layer list: stages at named blocks, who owns what
stage_run.py        NamedStage: a stage's pieces of such a model, run through its own forward
schedules.py        GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2 as pure action lists
schedule_clock.py   the clock that proves them sound and places them in time
partition.py        balance_by_cost and the refusals (pure)
p2p.py              StageLink: tagged, pre-posted point-to-point messages
timeline.py         the recorded timeline: reading, measured vs theoretical bubble, trace
timeline_report.py  timeline.png and the text of ``paratrain report``
"""

from paratrain.parallel.pipeline.description import PipelineStrategy
from paratrain.parallel.pipeline.engine import PipelineEngine

__all__ = ["PipelineEngine", "PipelineStrategy"]
