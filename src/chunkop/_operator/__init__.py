"""The operator layer: implicit chunked linear operators and the tools around them.

- :mod:`.row_operator`: ``RowOperator``, ``AbstractRowOperator``, the transpose view, and their
  lineax registrations (``linearise``, ``materialise``, ``diagonal``, ...), beside them;
- :mod:`.kernels`: the chunked ``mv``/``T.mv`` kernels and their derivative rules;
- :mod:`.row_layout`: the windowed layout (rows sorted once by target, read through windows);
- :mod:`.row_plan`: ``chunk_size="auto"`` for an operator, planned when it is built;
- :mod:`.row_sharding`: rows sharded over devices along the row axis;
- :mod:`.gram`, :mod:`.checks`, :mod:`.scipy_view`: ``gram_diagonal``, ``check_linear``, ``to_scipy``.

The transform layer (``chunkop.vmap``, ``map``, ``sum``, ``mean``) is the package's top level; this
layer builds on it and never the other way round.
"""
