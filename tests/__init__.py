"""Test package.

It is a package (not a loose directory of test files) so that the multi-rank worker processes can
import test modules by name: a multi-rank test sends ``("tests.test_x", "function_name")`` to every
rank, and the workers import it with the repository root on ``sys.path``.
"""
