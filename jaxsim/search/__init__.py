"""Semantic search: cosine similarity and an exact, mesh-sharded top-k index.

    model = jaxsim.load_pretrained(path)
    jaxsim.similarity(model, "A man plays guitar.", ["A man plays music.", "A cat sleeps."])
    index = build_index(model, sentences_or_file)   # or load_index(folder)
    index.search(model, "A man plays guitar.", threshold=0.6, top_k=5)
    index.save(folder)
"""
from jaxsim.search.index import IndexInfo, SearchIndex, TopK, build_index, load_index
from jaxsim.search.model_check import ModelMismatchError
from jaxsim.search.storage import IndexFileError
from jaxsim.search.vectors import SearchError, VectorError, model_ref, similarity

__all__ = ["IndexFileError", "IndexInfo", "ModelMismatchError", "SearchError", "SearchIndex",
           "TopK", "VectorError", "build_index", "load_index", "model_ref", "similarity"]
