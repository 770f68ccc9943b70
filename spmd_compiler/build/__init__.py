"""Turning a recording into a program, once per compile: ``pipeline`` (the stage list and its
runner), ``cache`` (programs kept on disk), ``shared_compile`` (one rank builds, the others
receive), ``program_check`` (every rank compiled the same program).

May import: trace, observe, runtime, state, features, passes, and the bottom layer.
"""
