"""Looking at what was built and what runs: ``visualize`` (graph dumps, the summary table),
``compile_log`` (the compile's line and recompile reasons), ``memory`` (measured peaks).

May import: runtime, state, features, passes, and the bottom layer.
"""
