"""Recording the step: the user's Python runs here, once per compile, and becomes one aten graph.

``record`` traces zero_grad, forward, backward and the optimizer step with make_fx on fake
tensors; ``reads`` records the Python the recording reads (attributes, the environment, rank
questions, the code that ran); ``block_reuse`` records a repeated block once and copies it; ``guards`` collects the
Python values the recording read; ``side_effects`` and ``replay`` find the Python state the step
changes and the statements that change it again after each call; ``trace_values`` gives the
recording the few real values it must read; ``dynamic_dims`` decides which sizes are symbolic;
``fake_kernels`` fills in the meta kernels torch lacks.

May import: runtime, state, features, passes, and the bottom layer (parallel_mode, errors,
torch_internals). Nothing here runs on a cached call.
"""
