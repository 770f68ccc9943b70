"""Features composed into recording and placement: ``tensor_parallel`` (+ ``halo_conv``, the
width-sharded convolution), ``mixed_precision``, ``subclass_params`` and ``per_call_parameters``
(FSDP2's all-gather extensions), ``accumulation`` (gradient accumulation).

May import: passes and the bottom layer (parallel_mode, errors, torch_internals).
"""
