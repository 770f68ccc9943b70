"""What runs on every call: ``dispatch`` (the call's key, which program runs, agreed across
ranks), ``program`` (the compiled program bound to the live state, its
workspaces), ``call_args`` (one call's arguments, flattened cheaply), ``step_modules`` (the step's
modules under one root), ``signature`` (the
contract between a built program and the runtime), ``agreement`` (every rank runs the same
program), ``replayed`` (the step's Python statements run again after the call).

May import: state, features, passes, and the bottom layer; never trace or build.
"""
