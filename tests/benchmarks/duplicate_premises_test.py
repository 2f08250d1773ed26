"""benchmarks/duplicate_premises.py on SNLI dev's own triplets (8 premises twice, 16 once) and
a tiny random-init BERT that fits them: without `mask_duplicates` every step whose batch holds
a premise twice spikes above 10x the run's median (to the 2 ln 2 / batch floor a repeated
premise forces), and no other step does; with it, no step is above 10x the median."""
from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import duplicate_premises  # noqa: E402

BATCH, STEPS, SKIP = 8, 500, 400


def test_masking_duplicate_premises_removes_the_spikes(tmp_path):
    data = duplicate_premises.write_snli_sample(tmp_path / "sample.csv")
    assert len(data.read_text().splitlines()) == 1 + 32
    record = duplicate_premises.run(data=data, random_init=True, dropout=0.0, steps=STEPS,
                                    skip=SKIP, batch_size=BATCH, learning_rate=2e-3, temp=0.02,
                                    workdir=tmp_path / "runs")
    repeated = [s for s in record["duplicate_steps"] if s > SKIP]
    assert len(repeated) >= 20  # the sample makes repeats common (43 of these 100 steps)
    unmasked, masked = record["unmasked"], record["masked"]
    assert len(unmasked["losses"]) == len(masked["losses"]) == STEPS
    # Unmasked: the spikes are exactly the steps with a repeated premise, each at least at the
    # floor a repeated pair forces (two rows of 8 that cannot both win: 2 ln 2 / 8).
    assert unmasked["spikes"] == repeated
    floor = 2 * math.log(2) / BATCH
    assert all(unmasked["losses"][s - 1] > 0.99 * floor for s in repeated)
    assert unmasked["max_over_median"] > 10
    # Masked: the same batches, no step above 10x the median.
    assert masked["spikes"] == [] and masked["max_over_median"] < 10
    assert all(masked["losses"][s - 1] < 0.1 * floor for s in repeated)
