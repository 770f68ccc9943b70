"""Pure FX graph passes over a traced training step. Imports only torch and sympy."""
