"""The command lines: every command's parser and entry point, and what they share (the modules:
docs/layout.md). Library code below takes plain arguments, never an argparse Namespace, and
nothing outside this package imports argparse.

Importing this package imports nothing (jaxsim/__init__.py reaches interrupts.py before JAX).
"""
