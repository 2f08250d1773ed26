"""The bottom layer: path naming, atomic writes and JSON, the workdir lock, TensorBoard scalars;
it imports nothing of jaxsim above it (docs/layout.md)."""
