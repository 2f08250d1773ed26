"""On-disk model formats, each read and written by one module: Hugging Face and
sentence-transformers folders, a train workdir's model record, orbax checkpoints. Above
storage/ and models/, below every workflow (docs/layout.md)."""
