"""Parallelism for the plain models, one file per dimension with its collectives beside it.

``mesh`` (process groups, rank order pp-dp-cp-tp), ``mappings`` (TP/SP autograd collectives),
``tensor_parallel`` (column/row-parallel linears, vocab-parallel embedding and loss), ``pipeline`` (the
schedule table executed with p2p), ``data_parallel`` (gradient buckets by reduce group, overlap, ZeRO-1),
``optimizer`` (AdamW on the buckets, clipping, LR schedule), ``recompute``, ``params`` (one ``ParamInfo``
per parameter) and ``parallelize`` (applies all of it to a meta-device model and records the ``ParamInfo``s).
"""
