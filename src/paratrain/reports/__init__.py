"""What a run leaves to read: the metrics file, its summary text, pictures and tables.

``metrics_file.py`` is the format (``metrics.jsonl``); ``run_data.py`` reads a run folder
once; ``text.py``, ``plot.py`` and ``compare.py`` turn that into what ``paratrain report``
prints and draws; ``tensorboard_log.py`` mirrors records for ``--tensorboard``.
"""
