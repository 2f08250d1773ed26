"""The bottom layer: path naming, atomic writes and JSON, the workdir lock, TensorBoard scalars.

It imports nothing of jaxsim but itself, `jaxsim.errors` and `jaxsim.registry`
(tests/layout_test.py), so every other layer can use it.
"""
