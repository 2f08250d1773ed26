"""Native kernels that XLA:CPU lacks, built on first use and called through XLA's FFI."""
