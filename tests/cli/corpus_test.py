"""`python -m jaxsim.cli.corpus`: SentEval's files made into training files."""
import csv

from jaxsim.cli import corpus
from jaxsim.data.readers import CORPUS_FILES


def _write_snli(folder, split, rows):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("s1", "s2", "labels")):
        (folder / f"{name}.{split}").write_text("".join(r[i] + "\n" for r in rows))


def test_snli_csv_writes_one_triplet_per_premise_with_both_labels(tmp_path, capsys):
    _write_snli(tmp_path / "SNLI", "dev", [
        ("A man plays.", "A person plays.", "entailment"),
        ("A man plays.", "Nobody plays.", "contradiction"),
        ("A dog runs.", "An animal runs.", "entailment"),  # no contradiction: dropped
    ])
    out = tmp_path / "nli.csv"
    assert corpus.main(["snli-csv", str(tmp_path / "SNLI"), str(out), "--splits", "dev"]) == 0
    rows = list(csv.reader(out.open(encoding="utf-8")))
    assert rows[1:] == [["A man plays.", "A person plays.", "Nobody plays."]]
    assert capsys.readouterr().out.strip() == f"{out}: 1 triplets"


def test_corpus_writes_the_deduplicated_sentences_a_line(tmp_path, capsys):
    root = tmp_path / "senteval"
    files = ["SNLI/s1.dev", "MR/rt-polarity.pos"]
    for rel, text in zip(files, ["One two three.\nOne two three.\nShort one\n",
                                 "Four five six seven.\nno\n"]):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out = tmp_path / "corpus.txt"
    # The command reads every shipped corpus file: the others hold no 3+ word sentence.
    for rel in CORPUS_FILES:
        if rel not in files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("x\n")
    assert corpus.main(["corpus", str(root), str(out)]) == 0
    # Deduplicated, first-seen order, fragments under 3 words dropped.
    assert out.read_text().splitlines() == ["One two three.", "Four five six seven."]
    assert capsys.readouterr().out.strip() == f"{out}: 2 sentences"
