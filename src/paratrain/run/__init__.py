"""A training run: prepared once in the parent, then the loop every worker runs.

``fit.py`` is the whole run (``fit(config)``); ``prepare.py`` does every check and the
one-off work (meta model, resume, plan) before any worker starts; ``worker.py`` is the
loop as setup, step, log, finish. The package imports nothing at import time so that
``paratrain.config`` and the command line can reach one module without the others.
"""
