"""Where the shipped data lives: `../shared/data/senteval` beside the repository, or
$JAXSIM_SENTEVAL."""
from __future__ import annotations

import os
from pathlib import Path

# The repository root is two levels above this file; shared/ sits beside the repository.
SENTEVAL_ROOT = Path(os.environ.get("JAXSIM_SENTEVAL")
                     or Path(__file__).resolve().parents[1].parent / "shared" / "data" / "senteval")
