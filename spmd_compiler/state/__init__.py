"""Live state on the mesh: ``placement`` (parameters and optimizer state as DTensors, meta-device
materialization), ``optimizer_state`` (state made before recording), ``eager`` (the model used
outside the step), ``saving`` (state dicts as the eager counterpart's), ``module_walk``.

May import: features, passes, and the bottom layer.
"""
