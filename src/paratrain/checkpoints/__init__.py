"""Canonical checkpoints: the on-disk format and reading weights from elsewhere.

``format.py`` writes and verifies shards + manifest (published atomically);
``locate.py`` says which checkpoint a path means; ``model_state.py`` loads weights from
any supported file; ``importing.py`` makes a checkpoint of weights saved elsewhere.
"""
